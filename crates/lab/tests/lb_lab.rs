//! Object mode's load balancer and liveness monitor in the object lab (network namespaces,
//! root): real nginx servers behind the nftables balancer, heartbeat clients inside the
//! server namespaces, curl as the unmodified client. Skips with a message when namespaces are
//! not available.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use unbroken_lab::lab;
use unbroken_control::object::hbproto::{self, Heartbeat, HealthWatch, HbState, ReplyCheck, ReplyVerdict};
use unbroken_control::object::lb::{
    self, encode_heartbeat, BucketView, EventKind, HeartbeatClient, Lb, LbConfig, LbStatus,
};
use unbroken_lab::objlab::{addr, server_mac as lab_mac, ObjectLab, ObjectOpts};

const KEY_HEX: &str = "00112233445566778899aabbccddeeff";
const INTERVAL: Duration = Duration::from_millis(5);
const DEADLINE: Duration = Duration::from_secs(10);
static DIRS: AtomicU32 = AtomicU32::new(0);

fn skip() -> bool {
    !lab::lab_or_skip(std::thread::current().name().unwrap_or("lb lab test"))
}

fn key() -> Vec<u8> {
    lb::parse_key_hex(KEY_HEX).unwrap()
}

/// Poll `f` every millisecond until it returns Some, at most `DEADLINE`.
fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A lab with nginx on every server, the balancer in the lb namespace and heartbeat clients.
/// Fields drop in order: heartbeats, balancer, nginx, lab, then the temp dir.
struct World {
    hb: Vec<Option<HeartbeatClient>>,
    lb: Option<Lb>,
    nginx: Vec<Option<Child>>,
    lab: ObjectLab,
    dir: PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        self.hb.clear();
        self.lb = None;
        for c in self.nginx.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl World {
    fn new(nginx: bool, tweak: impl FnOnce(&mut LbConfig)) -> World {
        let lab = ObjectLab::build(ObjectOpts::default()).expect("object lab");
        let dir = std::env::temp_dir().join(format!(
            "ub-lblab-{}-{}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = World {
            hb: Vec::new(),
            lb: None,
            nginx: Vec::new(),
            lab,
            dir,
        };
        if nginx {
            for i in 1..=w.lab.n_servers() {
                let c = w.start_nginx(i);
                w.nginx.push(Some(c));
            }
        }
        let mut cfg = w.lab.lb_config();
        cfg.key = KEY_HEX.to_string();
        // These tests revive servers many times within minutes; the revive hold doubles with
        // each recent death (unbroken_control::object::detector's unit tests cover that): keep it short here.
        cfg.revive_hold_ms = 20;
        tweak(&mut cfg);
        let l = lab::in_ns(w.lab.lb(), || Lb::start(cfg))
            .unwrap()
            .expect("start lb");
        eprintln!("ruleset:\n{}", l.ruleset());
        w.lb = Some(l);
        w
    }

    fn start_nginx(&self, i: usize) -> Child {
        let docroot = self.dir.join(format!("www{i}"));
        std::fs::create_dir_all(&docroot).unwrap();
        std::fs::write(docroot.join("who"), format!("srv{i}\n")).unwrap();
        self.lab
            .start_nginx(i, &docroot, &self.dir.join(format!("run{i}")))
            .expect("nginx")
    }

    fn lb(&self) -> &Lb {
        self.lb.as_ref().unwrap()
    }

    fn status(&self) -> LbStatus {
        self.lb().status()
    }

    fn start_hb(&mut self, i: usize) {
        let ns = self.lab.server(i).to_string();
        let k = key();
        let c = lab::in_ns(&ns, || {
            HeartbeatClient::start(i as u16, addr::HEARTBEAT, INTERVAL, &k)
        })
        .unwrap()
        .expect("heartbeat client");
        while self.hb.len() < i {
            self.hb.push(None);
        }
        self.hb[i - 1] = Some(c);
    }

    fn stop_hb(&mut self, i: usize) {
        self.hb[i - 1] = None;
    }

    fn view(&self, i: usize) -> Option<BucketView> {
        self.hb[i - 1].as_ref().and_then(|c| c.view())
    }

    /// Wait until the kernel table has the latest decision and `pred` holds.
    fn wait_status(&self, what: &str, pred: impl Fn(&LbStatus) -> bool) -> LbStatus {
        wait_for(what, || {
            let s = self.status();
            (s.applied_epoch == s.epoch && pred(&s)).then_some(s)
        })
    }

    /// Wait until server `i`'s client holds a view of the kernel table's current epoch.
    fn wait_view(&self, i: usize) -> BucketView {
        wait_for(&format!("server {i}'s view of the current epoch"), || {
            let e = self.status().applied_epoch;
            self.view(i).filter(|v| v.epoch == e)
        })
    }

    /// `n` HTTP requests from the client to `url`; returns how often each server answered.
    fn requests(&self, url: &str, n: usize) -> BTreeMap<String, usize> {
        let mut hits = BTreeMap::new();
        for k in 0..n {
            let out = lab::run(
                self.lab.client(),
                Command::new("curl").args(["-sS", "-g", "-m", "5", "-w", " %{local_port}", url]),
            )
            .expect("run curl");
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(
                out.status.success(),
                "request {k} to {url} failed ({}): {} {}",
                out.status,
                text,
                String::from_utf8_lossy(&out.stderr)
            );
            let who = text.split_whitespace().next().unwrap_or("").to_string();
            assert!(who.starts_with("srv"), "unexpected body {text:?}");
            *hits.entry(who).or_insert(0) += 1;
        }
        hits
    }

    fn table_exists(&self, table: &str) -> bool {
        lab::in_ns(self.lab.lb(), || lb::table_exists(table))
            .unwrap()
            .unwrap()
    }

    fn kernel_owners(&self, table: &str, buckets: u16) -> Vec<Option<[u8; 6]>> {
        lab::in_ns(self.lab.lb(), || lb::kernel_owners(table, buckets))
            .unwrap()
            .unwrap()
    }

    /// The kernel's owner map equals the status's owners.
    fn check_kernel_matches(&self, s: &LbStatus) {
        let k = self.kernel_owners(&s.table, s.buckets);
        for (b, m) in k.iter().enumerate() {
            let want = self.lab.server_mac(s.owners[b] as usize);
            assert_eq!(
                *m,
                Some(want),
                "bucket {b}: kernel {m:?}, status owner {}",
                s.owners[b]
            );
        }
    }
}

const URL4: &str = "http://10.77.0.100/who";
const URL6: &str = "http://[fd77::100]/who";

fn all_three(hits: &BTreeMap<String, usize>) -> bool {
    ["srv1", "srv2", "srv3"]
        .iter()
        .all(|s| hits.contains_key(*s))
}

fn stats(v: &mut [u64]) -> String {
    v.sort_unstable();
    format!(
        "n={} min={} median={} max={}",
        v.len(),
        v[0],
        v[v.len() / 2],
        v[v.len() - 1]
    )
}

/// Test 1 + 2 + 4: balancing over all servers (IPv4 and IPv6), failure detection moves exactly
/// the dead server's buckets, `allowed` names exactly the moved buckets, recovery brings them
/// home, power loss is detected too, and the table is gone after stop.
#[test]
fn balances_detects_failure_moves_only_its_buckets_and_returns_them() {
    if skip() {
        return;
    }
    let mut w = World::new(true, |_| {});
    for i in 1..=3 {
        w.start_hb(i);
    }
    let s0 = w.wait_status("every server heard", |s| {
        s.servers.iter().all(|x| x.alive && x.heartbeats > 0)
    });
    eprintln!(
        "monitor realtime: {}, programmer realtime: {}",
        s0.monitor_realtime, s0.programmer_realtime
    );
    assert!(s0.events.is_empty(), "{:?}", s0.events);
    let home: Vec<u16> = (0..256u16).map(|b| b % 3 + 1).collect();
    assert_eq!(s0.owners, home);
    w.check_kernel_matches(&s0);
    for i in 1..=3 {
        let v = w.wait_view(i);
        let want: Vec<u16> = (0..256u16)
            .filter(|b| home[*b as usize] == i as u16)
            .collect();
        assert_eq!(v.owned_buckets(), want, "server {i}");
        assert!(
            v.allowed_buckets().is_empty(),
            "server {i}: nothing moved yet"
        );
    }

    // 1. 60 requests over IPv4 and 60 over IPv6 hit all three servers.
    let h4 = w.requests(URL4, 60);
    let h6 = w.requests(URL6, 60);
    eprintln!("IPv4 hits {h4:?}, IPv6 hits {h6:?}");
    assert!(all_three(&h4) && all_three(&h6), "{h4:?} {h6:?}");

    // 2. Server 2's heartbeats stop (several times, to measure detection).
    let mut detect = Vec::new();
    let mut observed = Vec::new();
    let mut applied = Vec::new();
    let mut epoch = s0.epoch;
    for cycle in 0..5 {
        let before = w.status();
        let stopped = Instant::now();
        w.stop_hb(2);
        let s = w.wait_status("server 2 declared dead", |s| !s.server(2).unwrap().alive);
        observed.push(stopped.elapsed().as_millis() as u64);
        let ev = s
            .events
            .iter()
            .rev()
            .find(|e| e.server == 2 && e.kind == EventKind::Down)
            .expect("down event")
            .clone();
        eprintln!("cycle {cycle}: {ev:?}");
        // On a machine loaded by other work, heartbeats can miss the deadline and live
        // servers flap (each cycle adds exactly one down and one up otherwise). The "allowed"
        // bitmaps then also hold the flapped buckets (failover window 60 s): those exact checks
        // only hold on a quiet run.
        let quiet = ev.n as usize == 2 * cycle + 1;
        if !quiet {
            eprintln!("cycle {cycle}: {} earlier events: live servers flapped under load; checking allowed bitmaps as supersets", ev.n - 1);
        }
        detect.push(ev.detect_ms.unwrap());
        applied.push(ev.applied_ms.unwrap());
        assert!(ev.detect_ms.unwrap() >= w.lb.as_ref().unwrap().config().dead_after_ms, "{ev:?}");
        assert!(s.epoch > epoch);
        epoch = s.epoch;
        let moved: BTreeSet<u16> = (0..256u16)
            .filter(|&b| before.owners[b as usize] == 2)
            .collect();
        assert_eq!(ev.buckets_moved, moved.len());
        assert_eq!(moved.len(), 85);
        for b in 0..256usize {
            if moved.contains(&(b as u16)) {
                assert_ne!(s.owners[b], 2, "bucket {b} still on the dead server");
            } else {
                assert_eq!(
                    s.owners[b], before.owners[b],
                    "bucket {b} moved but was not server 2's"
                );
            }
        }
        // round-robin: evenly over 1 and 3
        let to1 = moved.iter().filter(|&&b| s.owners[b as usize] == 1).count();
        assert!(
            to1.abs_diff(moved.len() - to1) <= 1,
            "{to1} of {}",
            moved.len()
        );
        w.check_kernel_matches(&s);
        assert_eq!(s.server(2).unwrap().buckets_owned, 0);
        let allowed_sum = s.server(1).unwrap().buckets_allowed + s.server(3).unwrap().buckets_allowed;
        if quiet {
            assert_eq!(allowed_sum, 85);
            // Only server 2 changed state.
            assert!(s.events.iter().all(|e| e.server == 2), "{:?}", s.events);
        } else {
            assert!(allowed_sum >= 85, "{allowed_sum}");
        }
        // The survivors' allowed bitmaps hold exactly the moved buckets, and only their own.
        let v1 = w.wait_view(1);
        let v3 = w.wait_view(3);
        let allowed: BTreeSet<u16> = v1
            .allowed_buckets()
            .into_iter()
            .chain(v3.allowed_buckets())
            .collect();
        if quiet {
            assert_eq!(allowed, moved);
        } else {
            assert!(allowed.is_superset(&moved), "{allowed:?} vs {moved:?}");
        }
        for (i, v) in [(1u16, &v1), (3, &v3)] {
            assert!(v
                .allowed_buckets()
                .iter()
                .all(|&b| s.owners[b as usize] == i));
            assert_eq!(v.owned_buckets(), s.buckets_of(i));
        }
        if cycle == 0 {
            // Every new request succeeds, on 1 and 3 only (server 2's nginx still runs: only
            // the balancer keeps traffic away from it).
            let h4 = w.requests(URL4, 60);
            let h6 = w.requests(URL6, 60);
            eprintln!("server 2 dead: IPv4 hits {h4:?}, IPv6 hits {h6:?}");
            assert!(!h4.contains_key("srv2") && !h6.contains_key("srv2"));
            assert!(h4.len() == 2 && h6.len() == 2, "{h4:?} {h6:?}");
        }

        // Resume: buckets return home, epoch increases.
        w.start_hb(2);
        // Alive after the revive hold; its buckets come home once the stand-ins' leases ran
        // out (unbroken_control::object::detector): wait for the kernel table to have them.
        let s = w.wait_status("server 2 alive again, its buckets home", |s| {
            s.server(2).unwrap().alive && s.owners == home && s.applied_epoch == s.epoch
        });
        assert_eq!(s.owners, home);
        assert!(s.epoch > epoch);
        epoch = s.epoch;
        w.check_kernel_matches(&s);
        let up = s.events.last().unwrap();
        assert_eq!(
            (up.server, up.kind, up.buckets_moved),
            (2, EventKind::Up, 85)
        );
        let v2 = w.wait_view(2);
        assert_eq!(v2.owned_buckets(), s.buckets_of(2));
        assert_eq!(
            v2.allowed_buckets(),
            s.buckets_of(2),
            "returned buckets changed hands"
        );
        assert!(w.wait_view(1).allowed_buckets().is_empty());
        assert!(w.wait_view(3).allowed_buckets().is_empty());
    }
    eprintln!(
        "detection (silence when declared dead, ms): {}; from stop to status (ms): {}; decision to kernel table (ms): {}",
        stats(&mut detect),
        stats(&mut observed),
        stats(&mut applied)
    );
    let h4 = w.requests(URL4, 60);
    assert!(all_three(&h4), "{h4:?}");

    // Power loss of server 2 (its heartbeat thread keeps trying; its link is down).
    let before = w.status();
    let t = Instant::now();
    w.lab.crash_server(2).unwrap();
    if let Some(mut c) = w.nginx[1].take() {
        let _ = c.wait(); // killed with the host
    }
    let s = w.wait_status("crashed server 2 declared dead", |s| {
        !s.server(2).unwrap().alive
    });
    let ev = s.events.last().unwrap().clone();
    eprintln!("power loss: {ev:?}, observed after {:?}", t.elapsed());
    assert_eq!(
        (ev.server, ev.kind, ev.buckets_moved),
        (2, EventKind::Down, 85)
    );
    for b in 0..256usize {
        if before.owners[b] != 2 {
            assert_eq!(s.owners[b], before.owners[b]);
        }
    }
    let h4 = w.requests(URL4, 30);
    let h6 = w.requests(URL6, 30);
    assert!(
        !h4.contains_key("srv2") && !h6.contains_key("srv2"),
        "{h4:?} {h6:?}"
    );
    w.lab.revive_server(2).unwrap();
    let c = w.start_nginx(2);
    w.nginx[1] = Some(c);
    // The same heartbeat client reaches the balancer again once the link is back.
    let s = w.wait_status("revived server 2 alive, its buckets home", |s| {
        s.server(2).unwrap().alive && s.buckets_of(2).len() == 85 && s.applied_epoch == s.epoch
    });
    assert_eq!(s.owners, home);
    let h4 = w.requests(URL4, 60);
    assert!(all_three(&h4), "{h4:?}");
    assert_eq!(lab::rsts_seen(w.lab.client()).unwrap(), 0);

    // 4. stop leaves the table (traffic keeps flowing); stop_and_remove removes it.
    let table = s.table.clone();
    assert!(w.table_exists(&table));
    let mut l = w.lb.take().unwrap();
    l.stop().unwrap();
    assert!(w.table_exists(&table), "table {table} gone after stop");
    let h4 = w.requests(URL4, 30);
    assert!(all_three(&h4), "stopped balancer's table still balances: {h4:?}");
    l.stop_and_remove().unwrap();
    assert!(!w.table_exists(&table), "table {table} survived stop_and_remove");
    l.stop_and_remove().unwrap(); // idempotent
    drop(l);
    // Without the table, VIP traffic is not balanced any more (routed toward the bridge,
    // where no server answers ARP or neighbour solicitations for the VIP).
    for url in [URL4, URL6] {
        let out = lab::run(
            w.lab.client(),
            Command::new("curl").args(["-sS", "-g", "-m", "2", url]),
        )
        .unwrap();
        assert!(
            !out.status.success(),
            "{url} answered without the balancer: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// Test 3: garbage heartbeats are counted, never keep a dead server alive, never crash the
/// monitor; a valid heartbeat still revives the server afterwards.
#[test]
fn garbage_heartbeats_are_counted_and_ignored() {
    if skip() {
        return;
    }
    let mut w = World::new(false, |c| {
        c.startup_grace_ms = 50;
        c.failover_window_s = 1;
    });
    w.start_hb(1);
    w.start_hb(3);
    let s = w.wait_status("server 2 (never heard) declared dead", |s| {
        !s.server(2).unwrap().alive
    });
    assert_eq!(s.buckets_of(2).len(), 0);
    let down_events = s.events.iter().filter(|e| e.server == 2).count();
    assert_eq!(down_events, 1, "{:?}", s.events);

    let k = key();
    let beat = |key: &[u8], server: u16, seq: u32| {
        encode_heartbeat(key, &Heartbeat { server, boot: 1, seq, cookie_t: 0, cookie: 0, len: 200 })
    };
    let good = beat(&k, 2, 1);
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("wrong key", beat(b"wrong key", 2, 7)),
        ("empty key", beat(b"", 2, 8)),
        ("short", good[..20].to_vec()),
        ("tiny", vec![b'U']),
        ("empty", vec![]),
        ("long", [good.as_slice(), &[0u8; hbproto::MAX_BEAT_LEN]].concat()),
        ("bad magic", {
            let mut g = good.to_vec();
            g[0] = b'X';
            g
        }),
        ("bad version", {
            let mut g = good.to_vec();
            g[4] = 9;
            g
        }),
        ("reply kind", {
            let mut g = good.to_vec();
            g[5] = 2;
            g
        }),
        ("flipped id", {
            let mut g = good.to_vec();
            g[7] ^= 1;
            g
        }),
        ("unknown server", beat(&k, 99, 1)),
        (
            "random",
            (0..300u32).map(|i| (i * 7919 % 251) as u8).collect(),
        ),
    ];
    // longer than the monitor's buffer (2048): arrives truncated, still a length error
    cases.push(("huge", [&good[..12], &[0x55; 4000][..]].concat()));
    let rounds = 20u64;
    let ns = w.lab.server(2).to_string();
    let before = w.status().counters;
    let start = Instant::now();
    lab::in_ns(&ns, || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..rounds {
            for (_, d) in &cases {
                s.send_to(d, addr::HEARTBEAT).unwrap();
            }
            // a garbage stream over > dead_after: must not keep server 2 alive
            std::thread::sleep(Duration::from_millis(2));
        }
    })
    .unwrap();
    eprintln!(
        "sent {} garbage datagrams in {:?}",
        rounds as usize * cases.len(),
        start.elapsed()
    );
    let want = |c: &lb::LbCounters| {
        (
            c.bad_mac - before.bad_mac,
            c.bad_length - before.bad_length,
            c.bad_magic - before.bad_magic,
            c.bad_version - before.bad_version,
            c.bad_kind - before.bad_kind,
            c.unknown_server - before.unknown_server,
        )
    };
    // wrong key, empty key, flipped id: mac; short, tiny, empty, long, huge: length;
    // bad magic and random: magic; version; kind; unknown server.
    let expect = (3 * rounds, 5 * rounds, 2 * rounds, rounds, rounds, rounds);
    let s = wait_for("every garbage datagram counted", || {
        let s = w.status();
        (want(&s.counters) == expect).then_some(s)
    });
    eprintln!("counters after garbage: {:?}", s.counters);
    assert!(!s.server(2).unwrap().alive, "garbage revived server 2");
    assert_eq!(s.events.iter().filter(|e| e.server == 2).count(), 1);
    assert!(s.server(1).unwrap().alive && s.server(3).unwrap().alive);

    // The monitor still works: valid heartbeats revive server 2 (after the revive hold; its
    // buckets after the stand-ins' leases).
    w.start_hb(2);
    let s = w.wait_status("server 2 alive, its buckets home", |s| {
        s.server(2).unwrap().alive && s.buckets_of(2).len() == 85 && s.applied_epoch == s.epoch
    });
    assert_eq!(s.buckets_of(2).len(), 85);
    assert_eq!(want(&s.counters), expect);

    // The returned buckets are allowed on server 2 for the failover window (1 s here), then
    // no longer.
    let t = Instant::now();
    let v = w.wait_view(2);
    assert_eq!(v.allowed_buckets(), s.buckets_of(2));
    wait_for("the failover window to close", || {
        w.view(2).filter(|v| v.allowed_buckets().is_empty())
    });
    let closed = t.elapsed();
    eprintln!("allowed bitmap emptied after {closed:?}");
    assert!(closed < Duration::from_millis(1100), "{closed:?}");
    assert_eq!(w.view(2).unwrap().owned_buckets(), s.buckets_of(2));
    assert_eq!(w.status().server(2).unwrap().buckets_allowed, 0);
}

/// Test 4b: `cleanup` removes a leftover table; `Lb::start` replaces one atomically; bad
/// configs are refused before anything is installed.
#[test]
fn cleanup_and_replace_leftover_tables() {
    if skip() {
        return;
    }
    let lab = ObjectLab::build(ObjectOpts::default()).unwrap();
    let ns = lab.lb().to_string();
    let mut cfg = lab.lb_config();
    cfg.table = "unbroken_lb_test".into();
    let exists = |t: &str| lab::in_ns(&ns, || lb::table_exists(t)).unwrap().unwrap();
    // a leftover, as a killed balancer leaves it
    let text = lb::ruleset(&cfg).unwrap();
    lab::in_ns(&ns, || lb::nft_apply(&text)).unwrap().unwrap();
    assert!(exists(&cfg.table));
    assert!(lab::in_ns(&ns, || lb::cleanup("unbroken_lb_test"))
        .unwrap()
        .unwrap());
    assert!(!exists(&cfg.table));
    assert!(!lab::in_ns(&ns, || lb::cleanup("unbroken_lb_test"))
        .unwrap()
        .unwrap());

    lab::in_ns(&ns, || lb::nft_apply(&text)).unwrap().unwrap();
    let c2 = cfg.clone();
    let mut l = lab::in_ns(&ns, || Lb::start(c2)).unwrap().unwrap();
    let owners = lab::in_ns(&ns, || lb::kernel_owners("unbroken_lb_test", 256))
        .unwrap()
        .unwrap();
    assert!(owners.iter().all(|o| o.is_some()));
    l.stop_and_remove().unwrap();
    assert!(!exists(&cfg.table));

    // A table deleted behind the balancer's back is installed again at the next change (here:
    // only server 3 sends heartbeats, so servers 1 and 2 are declared dead after the grace
    // period and every bucket ends on server 3).
    let mut c3 = cfg.clone();
    c3.startup_grace_ms = 300;
    let key = c3.key_bytes().unwrap();
    let listen = c3.listen;
    let l = lab::in_ns(&ns, || Lb::start(c3)).unwrap().unwrap();
    assert!(lab::in_ns(&ns, || lb::cleanup("unbroken_lb_test"))
        .unwrap()
        .unwrap());
    let _hb3 = lab::in_ns(lab.server(3), || {
        lb::HeartbeatClient::start(3, listen, Duration::from_millis(5), &key)
    })
    .unwrap()
    .unwrap();
    let s = wait_for("the table repaired", || {
        let s = l.status();
        (s.applied_epoch == s.epoch && !s.server(1).unwrap().alive && !s.server(2).unwrap().alive).then_some(s)
    });
    eprintln!("after repair: {:?} {:?}", s.counters, s.last_nft_error);
    assert!(s.counters.nft_errors >= 1);
    assert!(s.owners.iter().all(|&o| o == 3), "{:?}", s.owners);
    let owners = lab::in_ns(&ns, || lb::kernel_owners("unbroken_lb_test", 256))
        .unwrap()
        .unwrap();
    assert!(owners.iter().all(|o| *o == Some(lab_mac(3))), "{owners:?}");
    let mut l = l;
    l.stop_and_remove().unwrap();
    assert!(!exists(&cfg.table));

    let mut bad = cfg.clone();
    bad.ingress = "l0\"; flush ruleset; \"".into();
    let e = lab::in_ns(&ns, || Lb::start(bad)).unwrap().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    let mut nodev = cfg.clone();
    nodev.ingress = "nosuchdev".into();
    let e = lab::in_ns(&ns, || Lb::start(nodev)).unwrap().unwrap_err();
    eprintln!("missing device: {e}");
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
    assert!(!exists(&cfg.table));
}

/// The `unbroken` binary next to this test (`cargo build --release -p unbroken`), or None.
fn unbroken_bin() -> Option<PathBuf> {
    let bin = std::env::var_os("UNBROKEN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().unwrap();
            exe.parent().unwrap().parent().unwrap().join("unbroken")
        });
    if !bin.exists() {
        lab::skip_or_fail(
            "unbroken_lb_command",
            &format!(
                "{} not built (cargo build --release -p unbroken)",
                bin.display()
            ),
        );
        return None;
    }
    Some(bin)
}

/// A running `unbroken lb` with its stdout and stderr lines.
struct LbProc {
    child: Child,
    out: std::sync::mpsc::Receiver<String>,
    err: std::sync::mpsc::Receiver<String>,
}

impl LbProc {
    fn spawn(w: &World, bin: &Path, cfg: &Path, status: &Path) -> LbProc {
        let mut child = lab::spawn(
            w.lab.lb(),
            Command::new(bin)
                .args(["lb", "--config"])
                .arg(cfg)
                .arg("--status-file")
                .arg(status)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .unwrap();
        let lines = |r: Box<dyn std::io::Read + Send>| {
            let (tx, rx) = std::sync::mpsc::channel::<String>();
            std::thread::spawn(move || {
                for l in BufReader::new(r).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
            rx
        };
        let out = lines(Box::new(child.stdout.take().unwrap()));
        let err = lines(Box::new(child.stderr.take().unwrap()));
        LbProc { child, out, err }
    }

    /// The next line of `rx` containing `want` (bounded by `DEADLINE`).
    fn line(rx: &std::sync::mpsc::Receiver<String>, want: &str) -> String {
        let end = Instant::now() + DEADLINE;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let l = rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no line containing {want:?}"));
            eprintln!("unbroken lb: {l}");
            if l.contains(want) {
                return l;
            }
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// SIGTERM, then wait for a successful exit.
    fn terminate(mut self) {
        self.signal(libc::SIGTERM);
        let st = wait_for("unbroken lb to exit", || self.child.try_wait().unwrap());
        assert!(st.success(), "{st}");
        Self::line(&self.out, "stopped: table");
    }
}

impl Drop for LbProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_status(p: &Path) -> Option<LbStatus> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// The `unbroken lb` binary: bad config exits 2; a run prints events and writes the status
/// file; SIGHUP is logged and ignored (it keeps detecting); SIGTERM leaves the table, and
/// `--cleanup` removes it.
#[test]
fn unbroken_lb_command() {
    if skip() {
        return;
    }
    let Some(bin) = unbroken_bin() else { return };
    let mut w = World::new(false, |_| {});
    w.lb.take().unwrap().stop_and_remove().unwrap(); // this test runs the binary instead
    let dir = w.dir.clone();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "ingress = \"l0\"\n").unwrap();
    let out = Command::new(&bin)
        .args(["lb", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("missing field"), "{err}");

    let mut cfg = w.lab.lb_config();
    cfg.key = KEY_HEX.into();
    cfg.startup_grace_ms = 2000;
    let cfg_path = dir.join("lb.toml");
    std::fs::write(&cfg_path, toml::to_string(&cfg).unwrap()).unwrap();
    let status = dir.join("lb.json");
    let mut p = LbProc::spawn(&w, &bin, &cfg_path, &status);
    let ready = LbProc::line(&p.out, "ready");
    assert!(ready.contains("adopted=false"), "{ready}");
    for i in 1..=3 {
        w.start_hb(i);
    }
    wait_for("status file with every server heard", || {
        read_status(&status).filter(|s| s.servers.iter().all(|x| x.heartbeats > 0))
    });
    // SIGHUP: one log line, and the balancer keeps running and detecting.
    p.signal(libc::SIGHUP);
    LbProc::line(&p.err, "SIGHUP: reload not supported, ignored");
    assert!(p.running(), "SIGHUP killed unbroken lb");
    w.stop_hb(3);
    let line = LbProc::line(&p.out, "down");
    assert!(line.contains("server=3"), "{line}");
    wait_for("status file shows server 3 dead", || {
        read_status(&status).filter(|s| !s.server(3).unwrap().alive && s.applied_epoch == s.epoch)
    });
    assert!(p.running());
    assert!(w.table_exists(&cfg.table));
    p.terminate();
    assert!(w.table_exists(&cfg.table), "table removed on SIGTERM");
    assert!(read_status(&status).is_some());
    let out = lab::run(
        w.lab.lb(),
        Command::new(&bin).args(["lb", "--cleanup", "--config"]).arg(&cfg_path),
    )
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("removed table"));
    assert!(!w.table_exists(&cfg.table), "table survived --cleanup");
}

/// Restart and upgrade keep the data path: a client downloads through the balancer while
/// `unbroken lb` is SIGTERM-ed and started again. The table stays in the kernel meanwhile;
/// the new process adopts it (same epoch, same owners: the dead server's buckets stay with
/// the survivors instead of going home to it); the download is byte-exact with 0 RSTs.
#[test]
fn lb_restart_keeps_the_data_path() {
    if skip() {
        return;
    }
    let Some(bin) = unbroken_bin() else { return };
    let mut w = World::new(true, |_| {});
    w.lb.take().unwrap().stop_and_remove().unwrap(); // the binary instead
    let dir = w.dir.clone();
    // The same object on every server: 24 MiB, downloaded at 6 MB/s (about 4 s).
    let size = 24usize << 20;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let obj: Vec<u8> = (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    for i in 1..=3 {
        std::fs::write(dir.join(format!("www{i}")).join("big"), &obj).unwrap();
    }
    let mut cfg = w.lab.lb_config();
    cfg.key = KEY_HEX.into();
    let cfg_path = dir.join("lb.toml");
    std::fs::write(&cfg_path, toml::to_string(&cfg).unwrap()).unwrap();
    let status = dir.join("lb.json");
    let p = LbProc::spawn(&w, &bin, &cfg_path, &status);
    LbProc::line(&p.out, "ready");
    for i in [1, 2] {
        w.start_hb(i);
    }
    // Server 3 never speaks: declared dead after the grace, its buckets go to 1 and 2.
    let before = wait_for("server 3 dead, table applied", || {
        read_status(&status).filter(|s| {
            !s.server(3).unwrap().alive
                && s.server(1).unwrap().alive
                && s.server(2).unwrap().alive
                && s.applied_epoch == s.epoch
                && s.buckets_of(3).is_empty()
        })
    });
    let kernel_before = w.kernel_owners(&cfg.table, cfg.buckets);
    eprintln!("before restart: epoch {}", before.epoch);

    let out_file = dir.join("download");
    let mut curl = lab::spawn(
        w.lab.client(),
        Command::new("curl")
            .args(["-sS", "-g", "--limit-rate", "6M", "-m", "60", "-o"])
            .arg(&out_file)
            .args(["-w", "%{size_download}", "http://10.77.0.100/big"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .unwrap();
    // Restart once the download is under way.
    wait_for("the download to start", || {
        std::fs::metadata(&out_file)
            .ok()
            .filter(|m| m.len() > 1 << 20)
    });
    let t = Instant::now();
    p.terminate();
    assert!(w.table_exists(&cfg.table), "table removed on SIGTERM");
    assert_eq!(w.kernel_owners(&cfg.table, cfg.buckets), kernel_before);
    let got = std::fs::metadata(&out_file).unwrap().len();
    std::fs::remove_file(&status).unwrap(); // only the new process's status from here on
    let mut p = LbProc::spawn(&w, &bin, &cfg_path, &status);
    let ready = LbProc::line(&p.out, "ready");
    eprintln!("restarted after {:?} (download at {got} bytes)", t.elapsed());
    assert!(ready.contains("adopted=true"), "{ready}");
    assert!(ready.contains(&format!("epoch={}", before.epoch)), "{ready}");
    LbProc::line(&p.err, "adopted table");
    // Adopted: the same owners (server 3's buckets stay with 1 and 2 during the grace, when
    // server 3 counts as alive), then server 3 is declared dead with nothing to move.
    let after = wait_for("server 3 declared dead by the new process", || {
        read_status(&status).filter(|s| !s.server(3).unwrap().alive && s.applied_epoch == s.epoch)
    });
    assert!(after.adopted);
    assert_eq!(after.owners, before.owners, "the restart moved buckets");
    assert_eq!(after.epoch, before.epoch, "{:?}", after.events);
    assert!(after.events.iter().all(|e| e.buckets_moved == 0), "{:?}", after.events);
    assert_eq!(w.kernel_owners(&cfg.table, cfg.buckets), kernel_before);
    // SIGHUP to the new process: ignored, and the download carries on.
    p.signal(libc::SIGHUP);
    LbProc::line(&p.err, "SIGHUP: reload not supported, ignored");
    assert!(p.running(), "SIGHUP killed unbroken lb");

    let end = Instant::now() + Duration::from_secs(90);
    let st = loop {
        if let Some(st) = curl.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < end, "the download did not finish");
        std::thread::sleep(Duration::from_millis(20)); // polling a child's exit with a deadline
    };
    let mut err = String::new();
    use std::io::Read;
    curl.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(st.success(), "curl: {st} {err}");
    let data = std::fs::read(&out_file).unwrap();
    assert_eq!(data.len(), obj.len(), "download length");
    assert!(data == obj, "download differs from the object");
    assert!(got < obj.len() as u64, "the restart came after the download ended");
    assert_eq!(lab::rsts_seen(w.lab.client()).unwrap(), 0, "RSTs reached the client");
    // Server 3 comes back: its home buckets return, in the epoch after the adopted one.
    w.start_hb(3);
    let s = wait_for("server 3 back with its home buckets", || {
        read_status(&status).filter(|s| {
            s.server(3).unwrap().alive && s.applied_epoch == s.epoch && s.buckets_of(3).len() == 85
        })
    });
    assert!(s.epoch > before.epoch);
    p.terminate();
}

/// The store: redis in the store namespace answers servers over IPv4 and IPv6.
#[test]
fn redis_in_the_store_namespace() {
    if skip() {
        return;
    }
    use std::io::{Read, Write};
    let lab = ObjectLab::build(ObjectOpts {
        servers: 1,
        ..ObjectOpts::default()
    })
    .unwrap();
    let mut redis = lab.start_redis(addr::REDIS_PORT).expect("redis");
    for ip in [
        std::net::IpAddr::V4(addr::STORE_V4),
        std::net::IpAddr::V6(addr::STORE_V6),
    ] {
        let reply = lab::in_ns(lab.server(1), || -> std::io::Result<String> {
            let to = std::net::SocketAddr::new(ip, addr::REDIS_PORT);
            let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(b"SET k v\r\nGET k\r\n")?;
            let mut buf = [0u8; 12]; // "+OK\r\n" "$1\r\nv\r\n"
            s.read_exact(&mut buf)?;
            Ok(String::from_utf8_lossy(&buf).into_owned())
        })
        .unwrap()
        .unwrap();
        assert_eq!(reply, "+OK\r\n$1\r\nv\r\n", "via {ip}");
    }
    redis.kill().unwrap();
    redis.wait().unwrap();
}

/// A hand-made agent speaking the heartbeat protocol on its own socket in a server namespace,
/// so that a test can keep, replay and resize its beats.
struct RawAgent {
    sock: UdpSocket,
    rc: ReplyCheck,
    key: Vec<u8>,
    /// Every beat sent, in order.
    sent: Vec<Vec<u8>>,
}

impl RawAgent {
    fn new(ns: &str, server: u16, boot: u64) -> RawAgent {
        let sock = lab::in_ns(ns, || {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.connect(addr::HEARTBEAT).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            s
        })
        .unwrap();
        RawAgent { sock, rc: ReplyCheck::new(server, boot), key: key(), sent: Vec::new() }
    }

    /// Sends the next beat (`len`: its length; default: padded as an agent pads it).
    fn beat(&mut self, len: Option<usize>) -> Vec<u8> {
        let mut hb = self.rc.next_beat(0, false, || unreachable!());
        if let Some(l) = len {
            hb.len = l;
        }
        let b = encode_heartbeat(&self.key, &hb);
        self.sock.send(&b).unwrap();
        self.sent.push(b.clone());
        b
    }

    /// The next datagram (2 s at most).
    fn recv(&self) -> Vec<u8> {
        let mut buf = vec![0u8; 4096];
        let n = self.sock.recv(&mut buf).expect("an answer from the balancer");
        buf.truncate(n);
        buf
    }

    /// First beat: a challenge comes back; second beat (echoing it): a reply.
    fn bind(&mut self) {
        let b = self.beat(None);
        let c = self.recv();
        assert!(c.len() <= b.len(), "challenge {} > beat {}", c.len(), b.len());
        let c = hbproto::decode_challenge(&self.key, &c).expect("a challenge");
        assert!(self.rc.challenge(&c));
        self.exchange(None);
    }

    /// One beat and its reply (checked: for this beat, no longer than it).
    fn exchange(&mut self, len: Option<usize>) -> hbproto::Reply {
        let b = self.beat(len);
        let r = self.recv();
        assert!(r.len() <= b.len(), "reply {} > beat {}", r.len(), b.len());
        let r = hbproto::decode_reply(&self.key, &r).expect("a reply");
        assert!(matches!(self.rc.reply(&r), ReplyVerdict::Accept(_)), "reply {r:?} refused");
        r
    }

    fn local(&self) -> std::net::SocketAddr {
        self.sock.local_addr().unwrap()
    }
}

/// Issue 9 item 9: a captured beat replayed (from its own source, from another, after the
/// agent restarted) keeps no server alive and is counted.
#[test]
fn hostile_replayed_heartbeats_are_refused_and_counted() {
    if skip() {
        return;
    }
    let mut w = World::new(false, |c| c.startup_grace_ms = 50);
    w.start_hb(1);
    w.start_hb(3);
    let ns = w.lab.server(2).to_string();
    let mut a = RawAgent::new(&ns, 2, 0xa11ce);
    a.bind();
    for _ in 0..30 {
        a.exchange(None);
    }
    w.wait_status("server 2 alive", |s| s.server(2).unwrap().alive);
    assert_eq!(w.status().server(2).unwrap().heartbeat_source, Some(std::net::SocketAddr::new(lab_v4(2), a.local().port()).to_string()));
    // The agent dies; server 2 is declared dead.
    let s = w.wait_status("server 2 dead", |s| !s.server(2).unwrap().alive);
    let downs = s.events.iter().filter(|e| e.server == 2).count();
    let before = s.counters.clone();
    let beats2 = s.server(2).unwrap().heartbeats;
    // Every captured beat replayed, ten times over (longer than dead_after + revive hold), a
    // round at a time (a burst of hundreds could overflow the socket's buffer: lost, not
    // refused).
    let captured = a.sent.clone();
    let t = Instant::now();
    let refused = |c: &lb::LbCounters| c.replayed - before.replayed + c.challenges - before.challenges;
    let mut s = w.status();
    for round in 1..=10u64 {
        for b in &captured {
            a.sock.send(b).unwrap();
        }
        let want = round * captured.len() as u64;
        s = wait_for("a round of replays counted", || {
            let s = w.status();
            (refused(&s.counters) >= want).then_some(s)
        });
    }
    let n = 10 * captured.len() as u64;
    eprintln!("{n} replays in {:?}: {:?}", t.elapsed(), s.counters);
    // All but the first (its challenge-drawing beat) come from the bound source and boot.
    assert!(s.counters.replayed - before.replayed >= n - 10, "{:?}", s.counters);
    assert_eq!(s.server(2).unwrap().heartbeats, beats2, "a replay counted as a heartbeat");
    assert!(!s.server(2).unwrap().alive, "replays revived server 2");
    assert_eq!(s.events.iter().filter(|e| e.server == 2).count(), downs);

    // The same beats from another source: challenged, never accepted.
    let other = RawAgent::new(&ns, 2, 0);
    let before = w.status().counters;
    for b in &captured {
        other.sock.send(b).unwrap();
    }
    let s = wait_for("replays from another source counted", || {
        let s = w.status();
        (s.counters.challenges - before.challenges >= captured.len() as u64).then_some(s)
    });
    assert_eq!(s.server(2).unwrap().heartbeats, beats2, "a replay counted as a heartbeat");
    assert!(!s.server(2).unwrap().alive);

    // The agent restarts (new boot, new socket) and is alive again; then the old run's beats
    // are replayed from the old source: their cookies are stale, they move nothing.
    let mut b = RawAgent::new(&ns, 2, 0xb0b);
    b.bind();
    let s = wait_for("server 2 alive again", || {
        b.exchange(None);
        let s = w.status();
        s.server(2).unwrap().alive.then_some(s)
    });
    let before = s.counters.clone();
    for x in &captured[2..] {
        a.sock.send(x).unwrap();
    }
    b.exchange(None);
    let s = wait_for("stale cookies counted", || {
        let s = w.status();
        (s.counters.stale_cookies - before.stale_cookies >= captured.len() as u64 - 2).then_some(s)
    });
    assert!(s.counters.stale_cookies > before.stale_cookies, "{:?}", s.counters);
    assert_eq!(s.server(2).unwrap().heartbeat_source, Some(std::net::SocketAddr::new(lab_v4(2), b.local().port()).to_string()));
    // The restarted agent is still the one answered.
    b.exchange(None);
}

fn lab_v4(i: usize) -> std::net::IpAddr {
    std::net::IpAddr::V4(addr::server_v4(i as u8))
}

/// Issue 9 item 9: a beat shorter than its reply gets no answer (no amplification), and the
/// replies are never longer than the beats.
#[test]
fn hostile_short_beat_gets_no_answer() {
    if skip() {
        return;
    }
    let w = World::new(false, |_| {});
    let ns = w.lab.server(1).to_string();
    let mut a = RawAgent::new(&ns, 1, 7);
    a.bind();
    let r = a.exchange(None);
    let full = lb::reply_len(r.buckets);
    assert_eq!(a.sent.last().unwrap().len(), full, "an agent pads its beat to the reply");
    let before = w.status().counters;
    // A valid, fresh, bound beat of the minimum length (52 < 108 bytes): counted, unanswered.
    let short = a.beat(Some(hbproto::HEARTBEAT_MIN_LEN));
    assert!(short.len() < full);
    wait_for("the short beat counted", || {
        (w.status().counters.short_beats == before.short_beats + 1).then_some(())
    });
    // The next datagram is the reply to the next (full) beat, not an answer to the short one.
    let r = a.exchange(None);
    assert_eq!(r.seq, a.rc.next_beat(0, false, || 0).seq - 1);
    let s = w.status();
    assert_eq!(s.counters.replies, before.replies + 1);
    assert_eq!(s.counters.heartbeats, before.heartbeats + 1, "a short beat is no heartbeat");
}

/// Issue 9 misconfiguration: the balancer given a wrong server MAC says so (status and log).
#[test]
fn hostile_wrong_server_mac_is_reported() {
    if skip() {
        return;
    }
    let mut w = World::new(false, |c| c.servers[1].mac = "02:75:62:01:00:99".into());
    for i in 1..=3 {
        w.start_hb(i);
    }
    let s = wait_for("the MACs checked", || {
        let s = w.status();
        (s.servers.iter().all(|x| x.mac_ok.is_some())).then_some(s)
    });
    let s2 = s.server(2).unwrap();
    assert_eq!(s2.mac_ok, Some(false), "{s2:?}");
    assert_eq!(s2.observed_mac.as_deref(), Some(lb::mac_string(lab_mac(2)).as_str()));
    assert_eq!(s.server(1).unwrap().mac_ok, Some(true));
    assert_eq!(s.server(3).unwrap().mac_ok, Some(true));
    assert!(s.counters.mac_mismatches >= 1);
}

/// Issue 9 misconfiguration: a server whose heartbeats arrive on another network (a management
/// leg: a veth between its namespace and the balancer's, with the route to the heartbeat
/// address through it) leaves no neighbour entry on the forward device, so its (wrong) MAC
/// cannot be checked. Before, its status said `mac_ok: null` and nothing else, forever; now
/// `mac_check` says it is unverifiable, and why, within seconds.
#[test]
fn hostile_server_mac_behind_a_management_leg_is_said_unverifiable() {
    if skip() {
        return;
    }
    let mut w = World::new(false, |c| c.servers[1].mac = "02:75:62:01:00:99".into());
    let (srv, lbns) = (w.lab.server(2).to_string(), w.lab.lb().to_string());
    w.lab.lab.add_veth(&srv, "mgmt0", None, &lbns, "mgmt2", None).unwrap();
    w.lab.lab.add_addr(&srv, "mgmt0", "10.99.2.2/24").unwrap();
    w.lab.lab.add_addr(&lbns, "mgmt2", "10.99.2.1/24").unwrap();
    w.lab.lab.add_route(&srv, &format!("{}/32 via 10.99.2.1 dev mgmt0", addr::HEARTBEAT.ip())).unwrap();
    for i in 1..=3 {
        w.start_hb(i);
    }
    // 5 s without an entry, checked every second: a generous deadline of its own.
    let end = Instant::now() + Duration::from_secs(40);
    let s2 = loop {
        let s = w.status();
        let s2 = s.server(2).cloned().unwrap();
        if s2.mac_check.as_deref().is_some_and(|m| m.starts_with("unverifiable")) {
            break s2;
        }
        assert!(Instant::now() < end, "server 2's MAC never said unverifiable: {s2:?}");
        std::thread::sleep(Duration::from_millis(50)); // polling the status, bounded above
    };
    assert!(s2.heartbeat_source.as_deref().is_some_and(|a| a.starts_with("10.99.2.2:")), "{s2:?}");
    assert_eq!(s2.mac_ok, None, "{s2:?}");
    assert!(s2.mac_check.as_deref().unwrap().contains("10.99.2.2"), "{s2:?}");
    let s = wait_for("the other MACs checked", || {
        let s = w.status();
        [1, 3].iter().all(|&i| s.server(i).is_some_and(|x| x.mac_ok == Some(true) && x.mac_check.as_deref() == Some("ok"))).then_some(s)
    });
    assert_eq!(s.counters.mac_mismatches, 0, "nothing to compare for server 2");
}

/// Issue 9 misconfiguration: an agent with a wrong key or a wrong LB address learns within
/// seconds that its beats are not accepted, and what is wrong.
#[test]
fn hostile_agent_with_wrong_key_or_address_is_told() {
    if skip() {
        return;
    }
    let w = World::new(false, |_| {});
    let ns = w.lab.server(2).to_string();
    let diagnose = |c: &HeartbeatClient, k: &[u8], lb: std::net::SocketAddr| {
        let t0 = Instant::now();
        let mut hw = HealthWatch::new(lb, k, 0);
        let mut lines = Vec::new();
        wait_for("a diagnosis", || {
            if let Some(l) = hw.observe(&c.stats(), t0.elapsed().as_millis() as u64) {
                lines.push(l);
            }
            std::thread::sleep(Duration::from_millis(10)); // a status loop's period
            (hw.state() != HbState::Starting).then_some(())
        });
        (hw.state(), lines, t0.elapsed())
    };
    // Another key (long enough, but not the balancer's).
    let wrong = b"not the key of this balancer!!".to_vec();
    let c = lab::in_ns(&ns, || HeartbeatClient::start(2, addr::HEARTBEAT, INTERVAL, &wrong)).unwrap().unwrap();
    let (state, lines, took) = diagnose(&c, &wrong, addr::HEARTBEAT);
    eprintln!("wrong key: {state:?} after {took:?}: {lines:?}");
    assert_eq!(state, HbState::WrongKey);
    assert!(lines.len() == 1 && lines[0].contains("agent.key differs"), "{lines:?}");
    assert!(c.stats().replies == 0 && c.stats().nacks > 0);
    assert!(w.status().counters.bad_mac > 0);
    drop(c);
    // A wrong port: ICMP port unreachable.
    let bad = std::net::SocketAddr::new(addr::HEARTBEAT.ip(), addr::HEARTBEAT.port() + 1);
    let k = key();
    let c = lab::in_ns(&ns, || HeartbeatClient::start(2, bad, INTERVAL, &k)).unwrap().unwrap();
    let (state, lines, took) = diagnose(&c, &k, bad);
    eprintln!("wrong address: {state:?} after {took:?}: {lines:?}");
    assert_eq!(state, HbState::Unreachable);
    assert!(lines[0].contains("nothing listens there"), "{lines:?}");
    drop(c);
    // The right key and address: accepted, nothing to say.
    let c = lab::in_ns(&ns, || HeartbeatClient::start(2, addr::HEARTBEAT, INTERVAL, &k)).unwrap().unwrap();
    let (state, lines, _) = diagnose(&c, &k, addr::HEARTBEAT);
    assert_eq!(state, HbState::Ok);
    assert!(lines.is_empty(), "{lines:?}");
}
