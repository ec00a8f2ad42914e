//! Object mode with an object over 4 GiB (TRODS section 3.3: "if an object is over 4GB, TRODS
//! uses multiple objectIDs"; here 64-bit stream offsets and the record's progress mark). The
//! serving server loses power once before and once after the response passes 4 GiB of TCP
//! sequence space; curl must finish with every byte right and no reset.
//!
//! The deaths are placed by bytes received (20 % and 93 % of the object), not by time. The LB
//! declares a server dead after 25 ms of silence, which an overloaded machine can produce for
//! a live server; such a false death moves the connection too (and back), so the number of
//! failovers is exact only when the LB reports no false death, and otherwise bounded by them.

use std::path::PathBuf;
use std::time::Duration;
use unbroken::object::demo::{run_object, ObjectScenario};

#[test]
fn object_over_4gib_two_deaths_one_after_the_wrap() {
    if !unbroken_lab::lab::lab_or_skip("object_over_4gib_two_deaths_one_after_the_wrap") {
        return;
    }
    let size: u64 = (4 << 30) + (512 << 20);
    let s = ObjectScenario {
        size,
        crash_at: vec![0.2, 0.93],
        bin: Some(PathBuf::from(env!("CARGO_BIN_EXE_unbroken"))),
        timeout: Duration::from_secs(240),
        ..ObjectScenario::default()
    };
    let r = run_object(&s).expect("object lab");
    println!("report: {}", serde_json::to_string(&r).unwrap());
    assert!(r.crashes.len() == 2, "both deaths happened: {:?}", r.crashes);
    assert!(r.crashes[1].at_bytes > 1 << 32, "the second death is past the 4 GiB wrap: {:?}", r.crashes);
    assert_eq!(r.client_exit, Some(0), "curl exit status; {:?}", r.error);
    assert_eq!(r.bytes, size);
    assert!(r.sha256_ok, "sha256 of what curl received");
    assert_eq!(r.resets_seen_by_client, 0);
    assert!(r.failovers >= 2, "each death was failed over: {} failovers", r.failovers);
    if r.lb_false_deaths == 0 {
        assert_eq!(r.failovers, 2, "one failover per death, and no other death was declared");
    } else {
        // A false death of the serving server moves the connection away and back: two more.
        eprintln!("the LB declared {} false deaths (live servers); {} failovers", r.lb_false_deaths, r.failovers);
        assert!(r.failovers <= 2 + 2 * r.lb_false_deaths, "{} failovers for 2 deaths and {} false ones", r.failovers, r.lb_false_deaths);
    }
    assert!(r.ok, "{:?}", r.error);
    println!("longest stall {} ms", r.max_stall_ms);
}
