//! Kept-alive connections with no fault present (issue 8 item 5): consecutive requests (plain
//! GET, Range GET, HEAD; 1 KiB, 100 KiB and 10 MiB objects) and pipelined requests on one
//! connection, through object mode (Redis, nginx and `unbroken agent` on three servers behind
//! `unbroken lb`), driven by python3's `http.client` and by raw sockets (one with Nagle on,
//! one pipelining). Every response must be byte-exact and none may wait for a TCP
//! retransmission timer.
//!
//! Needs root; without it the test prints why and passes without running.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;
use unbroken::object::demo::{make_object, EnvOpts, ObjectEnv};
use unbroken_lab::lab;
use unbroken_lab::objlab::addr;

/// One lab at a time: the machine has two cores.
static LAB: Mutex<()> = Mutex::new(());

/// The client: consecutive and pipelined requests; for each, the time from the write to its
/// first byte and the longest wait between two reads of its response.
const CLIENT_PY: &str = include_str!("keepalive_client.py");

/// The longest a client may wait: from its write to a response's first byte, and between two
/// reads of a response. The stall of issue 8 item 5 waited for the client's retransmission
/// timer (or a server's): Linux never arms it below `TCP_RTO_MIN` (200 ms), so any wait for a
/// retransmission lasts at least 200 ms (261 to 2959 ms were seen), before the request leaves
/// the client (first byte) or inside a response (a gap). Without it a first byte takes a few
/// store round trips (under 1 ms each; about 1 ms seen) and reads follow each other within
/// milliseconds; the client with Nagle on also waits for its own delayed-ACK timer (40 ms,
/// 43 to 48 ms seen: the hold moves only after the client's ACK of the previous response,
/// see docs/architecture.md). A wait longer than 150 ms fails the test when the client's TCP
/// retransmitted meanwhile (`tcpi_total_retrans`: it waited for its timer), or when it lasts
/// `GROSS_MS` whatever the cause; a slow first byte without a retransmission is a loaded
/// machine (162 ms was seen once in a fresh-clone CI run next to other builds), logged only.
/// The whole transfer is only logged: a 10 MiB body's time depends on the machine's load, not
/// on this bug.
const BOUND_MS: f64 = 150.0;
/// A wait this long fails the test even without a retransmission.
const GROSS_MS: f64 = 1000.0;

#[derive(Debug)]
struct Res {
    conn: String,
    what: String,
    ms: f64,
    ttfb_ms: f64,
    gap_ms: f64,
    ok: bool,
    why: String,
    /// The client read this body slowly on purpose: its time is the pacing's.
    paced: bool,
    /// Segments the client's TCP retransmitted during this request.
    retrans: u64,
}

/// Runs the client in the client namespace against `host`; returns its results.
fn run_client(env: &ObjectEnv, host: &str) -> Vec<Res> {
    let script = env.dir.join("keepalive_client.py");
    std::fs::write(&script, CLIENT_PY).unwrap();
    let out = lab::run(
        env.lab.client(),
        Command::new("timeout")
            .arg("60")
            .arg("python3")
            .arg(&script)
            .arg(host)
            .arg(&env.docroot),
    )
    .expect("running python3 in the client namespace");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client against {host}: {}; stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("client output {stdout:?}: {e}"));
    v["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| Res {
            conn: r["conn"].as_str().unwrap_or("?").into(),
            what: r["what"].as_str().unwrap_or("?").into(),
            ms: r["ms"].as_f64().unwrap_or(f64::MAX),
            ttfb_ms: r["ttfb_ms"].as_f64().unwrap_or(f64::MAX),
            gap_ms: r["gap_ms"].as_f64().unwrap_or(f64::MAX),
            ok: r["ok"].as_bool().unwrap_or(false),
            why: r["why"].as_str().unwrap_or("").into(),
            paced: r["paced"].as_bool().unwrap_or(false),
            retrans: r["retrans"].as_u64().unwrap_or(u64::MAX),
        })
        .collect()
}

/// With `UB_PCAP=<dir>`, a capture of the client's link (`<dir>/<test>.pcap`) while the test
/// runs: what to look at when it fails.
struct Capture(std::process::Child);

impl Drop for Capture {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let _ = self.0.wait();
    }
}

fn capture(env: &ObjectEnv, name: &str) -> Option<Capture> {
    use std::io::Read;
    let file = PathBuf::from(std::env::var_os("UB_PCAP")?).join(format!("{name}.pcap"));
    let mut child = lab::spawn(
        env.lab.client(),
        Command::new("tcpdump")
            .args(["-i", unbroken_lab::objlab::dev::CLIENT, "-s", "128", "-U", "-w"])
            .arg(&file)
            .args(["tcp", "port", "80"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped()),
    )
    .ok()?;
    // tcpdump says "listening on ..." once it captures.
    let mut err = child.stderr.take()?;
    let (mut line, mut b) = (Vec::new(), [0u8; 1]);
    while !line.ends_with(b"\n") && err.read(&mut b).ok()? == 1 {
        line.push(b[0]);
    }
    eprintln!("{name}: capturing to {}", file.display());
    Some(Capture(child))
}

#[test]
fn keepalive_consecutive_and_pipelined_no_stall() {
    const NAME: &str = "keepalive_consecutive_and_pipelined_no_stall";
    if let Err(why) = lab::lab_available() {
        eprintln!("SKIP {NAME}: network-namespace lab unavailable: {why}");
        return;
    }
    let _g = LAB.lock().unwrap_or_else(|e| e.into_inner());
    let t = Instant::now();
    // No fault may be present: on a loaded machine the lab's usual 50 ms store deadline and
    // 25 ms failure detector fail stores and declare live servers dead (faults of their own,
    // with their own tests). Generous ones keep this run fault-free; the premise is checked.
    let opts = EnvOpts { bin: PathBuf::from(env!("CARGO_BIN_EXE_unbroken")), store_timeout_ms: 1000, dead_after_ms: 1000, ..Default::default() };
    let env = ObjectEnv::start(opts)
        .unwrap_or_else(|e| panic!("{NAME}: starting the object-mode system: {e}"));
    eprintln!("{NAME}: system up in {} ms ({})", t.elapsed().as_millis(), env.dir.display());
    make_object(&env.docroot.join("s1k"), 1 << 10, 91).unwrap();
    make_object(&env.docroot.join("m100k"), 100 << 10, 92).unwrap();
    make_object(&env.docroot.join("l10m"), 10 << 20, 93).unwrap();

    let _capture = capture(&env, NAME);
    // The same requests straight to server 1's own address (not steered to its agent): what
    // the client sees without protection, for the log.
    let plain = run_client(&env, &addr::server_v4(1).to_string());
    let rsts_plain = env.client_rsts();
    let prot = run_client(&env, &addr::VIP_V4.to_string());
    for (p, u) in prot.iter().zip(plain.iter().map(Some).chain(std::iter::repeat(None))) {
        eprintln!(
            "{NAME}: {:<16} {:<46} first byte {:>7.2} ms, longest gap {:>7.2} ms, all {:>7.2} ms (unprotected {:>7.2} / {:>7.2} / {:>7.2}) {}{}",
            p.conn,
            p.what,
            p.ttfb_ms,
            p.gap_ms,
            p.ms,
            u.map_or(f64::NAN, |u| u.ttfb_ms),
            u.map_or(f64::NAN, |u| u.gap_ms),
            u.map_or(f64::NAN, |u| u.ms),
            if p.ok { "ok" } else { "FAILED: " },
            p.why
        );
    }
    let e = |n: &str| {
        (1..=env.lab.n_servers())
            .filter_map(|i| env.agent_status(i))
            .map(|v| v["engine"][n].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    eprintln!(
        "{NAME}: engines: stores {} ok {} held {} released {} acks lowered {} pure ACKs dropped {} ACKs injected {} unprotected {}; client RSTs {}",
        e("stores"),
        e("stores_ok"),
        e("held"),
        e("released"),
        e("acks_lowered"),
        e("pure_acks_dropped"),
        e("acks_injected"),
        e("unprotected"),
        env.client_rsts()
    );
    let down: Vec<serde_json::Value> = env
        .lb_status()
        .ok()
        .and_then(|s| s["events"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["kind"] == "down")
        .collect();
    let failovers: u64 = (1..=env.lab.n_servers()).filter_map(|i| env.agent_status(i)).map(|v| v["agent"]["failovers"].as_u64().unwrap_or(0)).sum();
    eprintln!("{NAME}: LB down events {down:?}, failovers {failovers}, failed stores {}", e("stores_failed"));
    // The premise: every server healthy, every store in time.
    assert!(down.is_empty() && failovers == 0, "{NAME}: the LB declared a live server dead (overloaded machine?): not a fault-free run");
    assert_eq!(e("stores_failed"), 0, "{NAME}: a store missed its deadline (overloaded machine?): not a fault-free run");
    assert!(plain.iter().all(|r| r.ok), "{NAME}: the unprotected baseline failed: {plain:?}");
    assert_eq!(prot.len(), plain.len(), "{NAME}: not every request ran");
    for r in &prot {
        assert!(r.ok, "{NAME}: {} {}: {}", r.conn, r.what, r.why);
    }
    // A wait for a retransmission: over BOUND_MS with the client's TCP retransmitting
    // meanwhile; or over GROSS_MS at all.
    let waited = |ms: f64, r: &Res| ms >= GROSS_MS || (ms >= BOUND_MS && r.retrans > 0);
    for r in &prot {
        if r.ttfb_ms >= BOUND_MS {
            eprintln!("{NAME}: {} {}: first byte after {:.1} ms, {} retransmission(s) by the client", r.conn, r.what, r.ttfb_ms, r.retrans);
        }
        assert!(!waited(r.ttfb_ms, r), "{NAME}: {} {}: first byte after {:.1} ms with {} retransmission(s) by the client: a wait for a retransmission", r.conn, r.what, r.ttfb_ms, r.retrans);
    }
    for r in prot.iter().filter(|r| !r.paced) {
        assert!(!waited(r.gap_ms, r), "{NAME}: {} {}: a {:.1} ms wait inside the response with {} retransmission(s) by the client: a wait for a retransmission", r.conn, r.what, r.gap_ms, r.retrans);
    }
    assert_eq!(e("unprotected"), 0, "{NAME}: a connection went unprotected");
    // Counted apart: an RST on the unprotected connections is nginx's business, not ours.
    assert_eq!(env.client_rsts() - rsts_plain, 0, "{NAME}: RSTs reached the protected client ({rsts_plain} on the unprotected run)");
}
