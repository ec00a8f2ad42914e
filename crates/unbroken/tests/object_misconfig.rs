//! Object mode misconfigured as an operator might (issue 9, "Misconfiguration"): the real
//! `unbroken agent` and `unbroken lb` in network namespaces must say what is wrong, in their
//! log and their status file, within seconds — never run silently.
//!
//! Needs root; without it each test prints why and passes without running (fails instead with
//! UNBROKEN_REQUIRE_LAB=1).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use unbroken::object::demo::{EnvOpts, ObjectEnv};
use unbroken_lab::lab;
use unbroken_lab::objlab::addr;

const DEADLINE: Duration = Duration::from_secs(10);

fn opts() -> EnvOpts {
    EnvOpts { bin: PathBuf::from(env!("CARGO_BIN_EXE_unbroken")), servers: 2, ..Default::default() }
}

/// Polls `f` until it holds, at most `DEADLINE`; returns how long it took.
fn wait_for(what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20)); // polling a log or status file with a deadline
    }
    t.elapsed()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn status(p: &Path) -> serde_json::Value {
    serde_json::from_str(&read(p)).unwrap_or(serde_json::Value::Null)
}

/// An agent for server `i` started by hand from `conf` (its log in `log`).
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn agent(env: &ObjectEnv, i: usize, conf: &Path, log: &Path) -> Agent {
    let ns = env.lab.server(i).to_string();
    let c = lab::spawn(
        &ns,
        Command::new(env!("CARGO_BIN_EXE_unbroken"))
            .args(["agent", "--config"])
            .arg(conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap()),
    )
    .unwrap();
    Agent(c)
}

/// Agent 2 restarted with `edit` applied to its config (and a status file in a directory that
/// does not exist yet); returns it, its log and its status path.
fn misconfigured(env: &mut ObjectEnv, name: &str, edit: impl Fn(&str) -> String) -> (Agent, PathBuf, PathBuf) {
    env.stop_agent(2, libc::SIGTERM).unwrap();
    let text = read(&env.dir.join("agent2.toml"));
    let status = env.dir.join(format!("missing-{name}/deeper/agent2.json"));
    let text = edit(&text).replace(&env.agent_status_path(2).display().to_string(), &status.display().to_string());
    assert!(text.contains(&status.display().to_string()), "{text}");
    let conf = env.dir.join(format!("agent2-{name}.toml"));
    std::fs::write(&conf, text).unwrap();
    let log = env.dir.join(format!("agent2-{name}.log"));
    let a = agent(env, 2, &conf, &log);
    (a, log, status)
}

#[test]
fn hostile_agent_misconfigurations_are_loud() {
    if !lab::lab_or_skip("hostile_agent_misconfigurations_are_loud") {
        return;
    }
    // Redis down when the agents start.
    let mut env = ObjectEnv::start(EnvOpts { store: false, ..opts() }).expect("object system without a store");
    let log1 = env.dir.join("agent1.log");
    let took = wait_for("agent 1 to say the store is unreachable", || read(&log1).contains("agent: store unreachable"));
    eprintln!("store down at start: said after {took:?}");
    assert_eq!(status(&env.agent_status_path(1))["store_down"], true);
    let _redis = KillOnDrop(env.lab.start_redis(addr::REDIS_PORT).expect("redis"));
    let took = wait_for("agent 1 to say the store is back", || read(&log1).contains("agent: store reachable again"));
    eprintln!("store back: said after {took:?}");
    assert_eq!(read(&log1).matches("agent: store unreachable").count(), 1, "said once: {}", read(&log1));
    assert_eq!(status(&env.agent_status_path(1))["lb_heartbeats"]["state"], "ok");

    // A wrong key (long enough): the LB answers with a NACK; the agent says the keys differ.
    let (a, log, st) = misconfigured(&mut env, "key", |t| {
        t.replace(unbroken_lab::objlab::KEY_HEX, "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff")
    });
    let took = wait_for("the wrong key to be named", || read(&log).contains("agent.key differs from the LB's key"));
    eprintln!("wrong key: said after {took:?}");
    wait_for("the status file to say wrong_key", || status(&st)["lb_heartbeats"]["state"] == "wrong_key");
    assert_eq!(read(&log).matches("agent.key differs").count(), 1, "said once: {}", read(&log));
    assert!(env.lb_status().unwrap()["counters"]["bad_mac"].as_u64().unwrap() > 0);
    drop(a);

    // A wrong LB address (nothing listens on that port).
    let wrong = format!("{}:{}", addr::HEARTBEAT.ip(), addr::HEARTBEAT.port() + 1);
    let (a, log, st) = misconfigured(&mut env, "addr", |t| t.replace(&addr::HEARTBEAT.to_string(), &wrong));
    let took = wait_for("the wrong address to be named", || read(&log).contains("nothing listens there"));
    eprintln!("wrong address: said after {took:?}");
    wait_for("the status file to say unreachable", || status(&st)["lb_heartbeats"]["state"] == "unreachable");
    drop(a);

    // No key at all: refused at start, naming the field.
    env.stop_agent(2, libc::SIGTERM).unwrap();
    let text = read(&env.dir.join("agent2.toml"));
    let conf = env.dir.join("agent2-nokey.toml");
    std::fs::write(&conf, text.replace(&format!("key = \"{}\"\n", unbroken_lab::objlab::KEY_HEX), "")).unwrap();
    let out = lab::run(env.lab.server(2), Command::new(env!("CARGO_BIN_EXE_unbroken")).args(["agent", "--config"]).arg(&conf)).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("agent.key is missing or empty"), "{err}");

    // A second agent for the same queue in the same namespace while agent 1 runs: refused at
    // once, naming the one that runs, before it touches its rules, pins or queue (two started
    // together would otherwise both pass the rules' owner check and install over each other).
    let conf1 = env.dir.join("agent1.toml");
    let before = status(&env.agent_status_path(1))["pid"].clone();
    assert!(before.is_u64(), "agent 1's status names its pid");
    let out = lab::run(env.lab.server(1), Command::new(env!("CARGO_BIN_EXE_unbroken")).args(["agent", "--config"]).arg(&conf1)).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("already runs this job"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ready"), "{err}");
    wait_for("agent 1 to keep its heartbeats", || status(&env.agent_status_path(1))["lb_heartbeats"]["state"] == "ok");
    assert_eq!(status(&env.agent_status_path(1))["pid"], before, "agent 1 still the one that runs");
}

#[test]
fn hostile_lb_misconfigurations_are_refused() {
    if !lab::lab_or_skip("hostile_lb_misconfigurations_are_refused") {
        return;
    }
    let lab = unbroken_lab::objlab::ObjectLab::build(Default::default()).unwrap();
    let dir = std::env::temp_dir().join(format!("ub-misconf-lb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let run = |cfg: &unbroken_control::object::lb::LbConfig, status: &Path| {
        let conf = dir.join("lb.toml");
        std::fs::write(&conf, toml::to_string(cfg).unwrap()).unwrap();
        lab::spawn(
            lab.lb(),
            Command::new(env!("CARGO_BIN_EXE_unbroken"))
                .args(["lb", "--config"])
                .arg(&conf)
                .arg("--status-file")
                .arg(status)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .unwrap()
    };
    // Without a key: refused, nothing installed.
    let mut cfg = lab.lb_config();
    cfg.key = String::new();
    let out = run(&cfg, &dir.join("lb.json")).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("key is missing or empty") && err.contains("mandatory"), "{err}");
    assert!(!lab::in_ns(lab.lb(), || unbroken_control::object::lb::table_exists(&cfg.table)).unwrap().unwrap());
    // The status file's directory does not exist: created; the LB runs and writes it.
    let cfg = lab.lb_config();
    let status = dir.join("not/yet/lb.json");
    let c = run(&cfg, &status);
    wait_for("the status file in a new directory", || status.exists());
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    let out = c.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = lab::in_ns(lab.lb(), || unbroken_control::object::lb::cleanup(&cfg.table));
    let _ = std::fs::remove_dir_all(&dir);
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
