//! `unbroken demo object --chaos 3` as a test: three trials in which curl, wget and a python
//! keep-alive Range client download concurrently while seeded random faults hit the system
//! (server deaths, revives, false suspicions, store blips, agent restarts). Every transfer
//! must be byte-exact with exit status 0, no RST may reach the client, none may hang, no
//! connection may see two servers sending in one epoch, and every fault must have landed
//! mid-transfer (checked from the bytes each client had when it hit).
//!
//! The seed is fixed (so a failure replays with `unbroken demo object --chaos 3 --seed 3`);
//! `UB_CHAOS_SEED` picks another one.
//!
//! Needs root; without it the test prints why and passes without running (fails instead with
//! UNBROKEN_REQUIRE_LAB=1).

use std::path::PathBuf;
use unbroken::object::chaos::{run_chaos, ChaosOpts};

#[test]
fn object_chaos_three_trials() {
    if !unbroken_lab::lab::lab_or_skip("object_chaos_three_trials") {
        return;
    }
    let seed = std::env::var("UB_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    eprintln!("object_chaos_three_trials: seed {seed} (replay: unbroken demo object --chaos 3 --seed {seed})");
    let o = ChaosOpts { trials: 3, seed, bin: Some(PathBuf::from(env!("CARGO_BIN_EXE_unbroken"))), ..ChaosOpts::default() };
    let v = run_chaos(&o).expect("object lab");
    println!("report: {v}");
    assert_eq!(v["seed"], seed);
    assert_eq!(v["trials"], 3, "all three trials ran: {}", v["errors"]);
    assert_eq!(v["errors"].as_array().map(Vec::len), Some(0), "every fault was carried out: {}", v["errors"]);
    assert_eq!(v["byte_exact"]["total"], 9, "three clients per trial");
    assert_eq!(v["byte_exact"]["exact"], 9, "byte-exact transfers (sha256, length, exit 0): {}", v["failed_transfers"]);
    assert_eq!(v["resets_seen_by_client"], 0, "RSTs that reached the client: {}", v["resets"]);
    assert_eq!(v["hangs"], 0);
    assert_eq!(v["two_senders_seen"], 0, "{}", v["two_senders"]);
    assert_eq!(v["leftovers"].as_array().map(Vec::len), Some(0), "{}", v["leftovers"]);
    let faults: u64 = v["faults"].as_object().expect("faults by kind").values().map(|n| n.as_u64().unwrap()).sum();
    assert!(faults >= 3, "at least one fault per trial: {}", v["faults"]);
    assert_eq!(v["faults_mid_transfer"].as_u64(), Some(faults), "every fault landed mid-transfer: {}", v["fault_log"]);
    assert!(v["frames_captured"].as_u64().unwrap() > 0, "the sender capture saw the servers' frames");
    for s in [&v["stall_ms"], &v["stall_ms_by_client"]["curl"], &v["stall_ms_by_client"]["wget"], &v["stall_ms_by_client"]["python"]] {
        let (p50, p99, max) = (s["p50"].as_u64().unwrap(), s["p99"].as_u64().unwrap(), s["max"].as_u64().unwrap());
        assert!(p50 <= p99 && p99 <= max, "stall statistics {s}");
        assert!(s["samples"].as_u64().unwrap() > 0, "a stall sample per fault and client: {s}");
    }
    assert!(v["false_failovers"].is_u64());
    assert_eq!(v["ok"], true);
    eprintln!("object_chaos_three_trials: stall ms {} by client {}", v["stall_ms"], v["stall_ms_by_client"]);
}
