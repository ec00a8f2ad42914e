//! Who owns a guard's steering rules (issue 9, item 10), with the real `unbroken guard` in the
//! checkpoint lab's guard namespace: a second guard of the same queue refuses to start while the
//! first runs, naming it; once the first is killed (leaving its rules, as a crashed guard does)
//! a new one takes them over in place; another tool's rules in the same built-in chain survive
//! all of it, and the last guard's clean stop removes only its own.
//!
//! Needs root; without it the test says why and passes (fails with UNBROKEN_REQUIRE_LAB=1).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};
use unbroken_lab::lab::{self, addr, CheckpointLab, CheckpointOpts, Lab};

const QUEUE: u16 = 9;

struct Guard {
    child: Child,
    out: Receiver<String>,
    err: Option<std::thread::JoinHandle<String>>,
}

impl Guard {
    fn spawn(ns: &str, cfg: &std::path::Path) -> Guard {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_unbroken"));
        cmd.arg("guard").arg("--config").arg(cfg).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = lab::spawn(ns, &mut cmd).expect("spawn guard");
        let (tx, out) = channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let stderr = child.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                s.push_str(&l);
                s.push('\n');
            }
            s
        });
        Guard { child, out, err: Some(err) }
    }
    fn wait_ready(&mut self) {
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if let Ok(l) = self.out.recv_timeout(Duration::from_millis(100)) {
                if l.starts_with("unbroken guard: ready") {
                    return;
                }
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("the guard exited ({st}) instead of getting ready");
            }
        }
        panic!("the guard was not ready within 20 s");
    }
    /// Waits (generous deadline) for the process to exit; its status and stderr.
    fn exit(mut self) -> (std::process::ExitStatus, String) {
        let end = Instant::now() + Duration::from_secs(30);
        let st = loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                break st;
            }
            assert!(Instant::now() < end, "the guard did not exit within 30 s");
            std::thread::sleep(Duration::from_millis(10)); // polling a child's exit with a deadline
        };
        (st, self.err.take().and_then(|h| h.join().ok()).unwrap_or_default())
    }
    fn signal(&self, sig: i32) {
        // SAFETY: plain syscall on our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ipt(ns: &str, a: &[&str]) -> String {
    let out = lab::run(ns, Command::new("iptables").args(["-w", "-t", "mangle"]).args(a)).expect("iptables");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn hostile_second_guard_refuses_then_takes_over() {
    let name = "guard_rules_owner";
    if !lab::lab_or_skip(name) {
        return;
    }
    let lab: CheckpointLab = Lab::checkpoint(CheckpointOpts::default()).expect("lab");
    let ns = lab.guard.clone();
    let dir = std::env::temp_dir().join(format!("unbroken-{}-{name}", lab.prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("guard.toml");
    std::fs::write(
        &cfg,
        format!(
            "[guard]\nqueue = {QUEUE}\nplacement = \"gateway\"\napp_interface = \"{}\"\ncontrol = [\"{}:7909\"]\nkey = \"00112233445566778899aabbccddeeff\"\nallowed_sources = [\"10.77.2.0/24\"]\n\n[[service]]\naddr = \"{}\"\nport = 7000\n",
            lab::dev::GUARD_LAN,
            addr::GUARD_LAN_V4,
            addr::SERVICE_V4
        ),
    )
    .unwrap();
    // Another tool's rules in the chain our jump goes to.
    ipt(&ns, &["-A", "FORWARD", "-p", "udp", "--dport", "9", "-m", "comment", "--comment", "other-tool", "-j", "ACCEPT"]);
    ipt(&ns, &["-I", "FORWARD", "1", "-p", "tcp", "--dport", "22", "-j", "ACCEPT"]);
    let foreign = |ns: &str| ipt(ns, &["-S", "FORWARD"]).lines().filter(|l| !l.contains("UNBROKEN")).map(String::from).collect::<Vec<_>>();
    let foreign_before = foreign(&ns);
    let chain = format!("UNBROKEN-Q{QUEUE}");
    let tag_of = |pid: u32| format!("unbroken-owner:{pid}:");

    let mut first = Guard::spawn(&ns, &cfg);
    first.wait_ready();
    let owned = ipt(&ns, &["-S", &chain]);
    assert!(owned.contains(&tag_of(first.child.id())), "{owned}");

    // The second refuses, naming the first, and touches nothing.
    let (st, err) = Guard::spawn(&ns, &cfg).exit();
    assert!(!st.success(), "a second guard on a live guard's rules must refuse: {err}");
    assert!(err.contains(&format!("is in use by pid {} (", first.child.id())) && err.contains("unbroken guard"), "{name}: {err}");
    assert_eq!(ipt(&ns, &["-S", &chain]), owned, "the refused guard touched the rules");

    // The first dies (its rules stay); the next takes them over, jump in place.
    let jumps = ipt(&ns, &["-S", "FORWARD"]).lines().filter(|l| l.contains(&chain)).count();
    assert_eq!(jumps, 1);
    first.signal(libc::SIGKILL);
    let _ = first.exit();
    assert_eq!(ipt(&ns, &["-S", &chain]), owned, "a killed guard leaves its rules");
    let mut third = Guard::spawn(&ns, &cfg);
    third.wait_ready();
    let taken = ipt(&ns, &["-S", &chain]);
    assert!(taken.contains(&tag_of(third.child.id())) && !owned.lines().skip(1).any(|l| taken.contains(l)), "{taken}");
    assert_eq!(ipt(&ns, &["-S", "FORWARD"]).lines().filter(|l| l.contains(&chain)).count(), 1, "one jump");
    assert_eq!(foreign(&ns), foreign_before);

    // A clean stop with nothing to renumber removes its own rules and nothing else.
    third.signal(libc::SIGTERM);
    let (st, err) = third.exit();
    assert!(st.success(), "{err}");
    assert!(!ipt(&ns, &["-S"]).contains(&chain), "the stopped guard's rules are gone");
    assert_eq!(foreign(&ns), foreign_before, "other tools' rules survive");
    drop(lab);
    let _ = std::fs::remove_dir_all(&dir);
}
