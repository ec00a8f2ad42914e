//! Checkpoint mode end to end in network namespaces, with real Linux TCP on both sides: the
//! guard (NFQUEUE), the example journal server (SDK) and an unmodified peer (plain sockets).
//! Every test checks what the peer saw: every reply byte verified and the sha256 of all of them,
//! its exit status, and that no RST reached it; the longest stall is printed.
//!
//! Needs root; without it each test prints why and passes without running (the summary of
//! scripts/test.sh says whether the lab ran); with UNBROKEN_REQUIRE_LAB=1 it fails instead.

use std::sync::Mutex;
use std::time::Duration;
use unbroken::checkpoint::scenario::{run_checkpoint, run_misconfigured, Crash, Misconfig, MisconfigReport, Report, Scenario};

/// One lab at a time: two cores, and the stall figures mean more without contention.
static LAB: Mutex<()> = Mutex::new(());

fn lab_or_skip(name: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    if !unbroken_lab::lab::lab_or_skip(name) {
        return None;
    }
    std::env::set_var("UNBROKEN_BIN", env!("CARGO_BIN_EXE_unbroken"));
    Some(LAB.lock().unwrap_or_else(|e| e.into_inner()))
}

fn check(name: &str, s: &Scenario) -> Report {
    let r = run_checkpoint(s).unwrap_or_else(|e| panic!("{name}: scenario failed to run: {e}"));
    let mut shown = serde_json::to_value(&r).unwrap();
    shown.as_object_mut().unwrap().remove("guard");
    eprintln!("{name}: {shown}");
    eprintln!("{name}: guard counters {}", r.guard["counters"]);
    assert_eq!(r.resets_seen_by_peer, 0, "{name}: RSTs reached the peer");
    assert_eq!(r.peer_exit_code, Some(0), "{name}: peer exit status ({:?})", r.error);
    assert!(r.sha256_ok, "{name}: reply hash mismatch");
    let unit = if s.echo { unbroken_journal::RECORD_LEN } else { unbroken_journal::REPLY_LEN } as u64;
    assert_eq!(r.bytes_verified, s.records * unit, "{name}: not every byte verified");
    assert!(r.ok, "{name}: {:?}", r.error);
    eprintln!("{name}: longest stall {} ms over {} crash(es)", r.max_stall_ms, r.crashes);
    // The guard runs on the path the scenario asked for (issue 22: every test on either).
    let fp = &r.guard["fast_path"];
    eprintln!("{name}: fast path {fp}");
    let expected_on = s.fast_path && !s.local_guard;
    assert_eq!(fp["on"].as_bool(), Some(expected_on), "{name}: fast path {fp}");
    if !s.fast_path {
        assert!(fp["off_because"].as_str().is_some_and(|w| w.contains("fast_path = false")), "{name}: {fp}");
    }
    r
}

/// With the fast path on, the kernel carried most of the connection's packets: more than
/// went through the queue.
fn carried_by_the_kernel(name: &str, s: &Scenario, r: &Report) {
    if !s.fast_path || s.local_guard {
        return;
    }
    let fp = &r.guard["fast_path"];
    let kernel = fp["kernel_outgoing"].as_u64().unwrap_or(0) + fp["kernel_incoming"].as_u64().unwrap_or(0);
    let queued = r.guard["counters"]["packets"].as_u64().unwrap_or(0);
    assert!(kernel > queued, "{name}: the kernel carried {kernel} packets, the queue {queued}: {fp}");
    assert!(fp["handoff"]["installed"].as_u64().unwrap_or(0) >= 1, "{name}: {fp}");
}

fn base(records: u64) -> Scenario {
    Scenario { records, rate: 20_000, timeout: Duration::from_secs(240), ..Scenario::default() }
}

#[test]
fn app_crash_restarts_on_same_host() {
    let Some(_g) = lab_or_skip("app_crash") else { return };
    let s = Scenario { crashes: vec![Crash::App, Crash::App, Crash::App], ..base(30_000) };
    let r = check("app_crash", &s);
    carried_by_the_kernel("app_crash", &s, &r);
    assert_eq!(r.crashes, 3);
    assert!(r.guard["counters"]["recovered"].as_u64().unwrap_or(0) >= 3, "each crash is a recovery");
}

#[test]
fn host_crash_recovers_on_other_host() {
    // app2 has another TS clock (tcp_timestamps=2) and another window scale: PAWS and window
    // translation are exercised for real.
    let Some(_g) = lab_or_skip("host_crash") else { return };
    let s = Scenario { crashes: vec![Crash::Host], heterogeneous: true, ..base(30_000) };
    let r = check("host_crash", &s);
    carried_by_the_kernel("host_crash", &s, &r);
    assert!(r.crash_log[0].app_host.ends_with("app2"));
}

#[test]
fn guard_crash_is_turned_into_app_recovery() {
    let Some(_g) = lab_or_skip("guard_crash") else { return };
    let r = check("guard_crash", &Scenario { crashes: vec![Crash::App, Crash::Guard], ..base(30_000) });
    let c = &r.guard["counters"];
    assert!(c["no_checkpoint_reset"].as_u64().unwrap_or(0) >= 1, "the restarted guard forced the app to recover: {c}");
}

#[test]
fn guard_restarts_alone() {
    // Section 2.7 on its own: the guard is SIGKILLed and restarted twice while the app runs.
    // The new guard knows no Δ: it resets the app's next packet, and the app recovers.
    let Some(_g) = lab_or_skip("guard_restart") else { return };
    let r = check("guard_restart", &Scenario { crashes: vec![Crash::Guard, Crash::Guard], ..base(30_000) });
    assert_eq!(r.crashes, 2);
    let c = &r.guard["counters"];
    assert!(c["no_checkpoint_reset"].as_u64().unwrap_or(0) >= 1 && recoveries(c) >= 1, "the last guard forced a recovery and answered it: {c}");
}

#[test]
fn app_killed_again_during_recovery() {
    // The app is killed, restarted, and killed again in the middle of recovering its
    // connection (new socket connected through the guard, nothing resent yet), twice.
    let Some(_g) = lab_or_skip("app_in_recovery") else { return };
    let r = check("app_in_recovery", &Scenario { crashes: vec![Crash::AppDuringRecovery, Crash::App, Crash::AppDuringRecovery], ..base(30_000) });
    assert_eq!(r.crashes, 3);
    assert!(r.guard["counters"]["recovered"].as_u64().unwrap_or(0) >= 5, "five recoveries (two cut short): {}", r.guard["counters"]);
}

#[test]
fn guard_killed_during_app_recovery() {
    // The guard dies while the app is recovering (its recovered socket connected through the
    // old guard, nothing resent yet): the new guard knows neither Δ nor the checkpoint.
    let Some(_g) = lab_or_skip("guard_in_recovery") else { return };
    // 90,000 records at 20,000/s: a guard restart during recovery stalls the stream up to ~1.5 s and
    // the peer then catches up, so with 30,000 records the later crash points were passed before
    // they could be injected (a fresh-clone CI run: "only 1 of 3 crashes were injected").
    let r = check("guard_in_recovery", &Scenario { crashes: vec![Crash::GuardDuringRecovery, Crash::App, Crash::GuardDuringRecovery], ..base(90_000) });
    assert_eq!(r.crashes, 3);
    assert!(recoveries(&r.guard["counters"]) >= 1, "the last guard answered a recovery: {}", r.guard["counters"]);
}

/// Recovery SYNs a guard answered: at once (O5), or from the peer's ACK when it did not know
/// ackB yet (section 6).
fn recoveries(c: &serde_json::Value) -> u64 {
    c["recovered"].as_u64().unwrap_or(0) + c["recovered_from_peer_ack"].as_u64().unwrap_or(0)
}

#[test]
fn sighup_never_kills_the_guard() {
    // SIGHUP (no reload) is logged, counted and ignored: the guard keeps renumbering through an
    // app crash after it, the transfer ends byte-exact with 0 RSTs and the guard still runs.
    let Some(_g) = lab_or_skip("guard_hup") else { return };
    let r = check("guard_hup", &Scenario { crashes: vec![Crash::GuardHangup, Crash::App], ..base(30_000) });
    assert!(r.guard["sighup_ignored"].as_u64().unwrap_or(0) >= 1, "{}", r.guard);
    assert!(r.guard["counters"]["recovered"].as_u64().unwrap_or(0) >= 1, "{}", r.guard["counters"]);
}

#[test]
fn guard_and_app_crash_together() {
    let Some(_g) = lab_or_skip("guard_and_app") else { return };
    check("guard_and_app", &Scenario { crashes: vec![Crash::App, Crash::GuardAndApp], ..base(30_000) });
}

#[test]
fn host_then_guard_crash_ipv6() {
    let Some(_g) = lab_or_skip("ipv6") else { return };
    check("ipv6", &Scenario { crashes: vec![Crash::Host, Crash::Guard], ipv6: true, ..base(30_000) });
}

#[test]
fn crash_after_peer_half_close() {
    // The peer has sent everything and shut down its writing side; the app crashes after
    // acknowledging the peer's FIN while replies may still be in flight.
    let Some(_g) = lab_or_skip("half_close") else { return };
    check("half_close", &Scenario { crashes: vec![], app_crash_point: Some("after-eof".into()), rate: 0, ..base(20_000) });
}

#[test]
fn crash_during_fin_after_shutdown_command() {
    let Some(_g) = lab_or_skip("fin_after_shutdown") else { return };
    check("fin_after_shutdown", &Scenario { crashes: vec![], app_crash_point: Some("after-shutdown".into()), ..base(10_000) });
}

#[test]
fn crash_right_after_the_apps_fin() {
    let Some(_g) = lab_or_skip("after_fin") else { return };
    check("after_fin", &Scenario { crashes: vec![], app_crash_point: Some("after-fin".into()), ..base(10_000) });
}

#[test]
fn crash_mid_read_at_a_byte_position() {
    // The crash comes from inside the app between journaling input and acknowledging it.
    let Some(_g) = lab_or_skip("mid_read") else { return };
    check("mid_read", &Scenario { crashes: vec![Crash::Host], crash_at: Some(vec![0.7]), app_crash_point: Some("after-bytes:777777".into()), ..base(20_000) });
}

#[test]
fn crash_during_the_handshake() {
    // The app dies right after its kernel accepted the connection, before it told the guard or
    // journaled a record: the restarted app ADOPTs the connection from the guard and recovers it.
    let Some(_g) = lab_or_skip("handshake") else { return };
    let r = check("handshake", &Scenario { crashes: vec![Crash::App], app_crash_point: Some("accepted".into()), ..base(10_000) });
    assert!(r.guard["counters"]["adopted"].as_u64().unwrap_or(0) >= 1, "{}", r.guard["counters"]);
}

#[test]
fn more_than_4_gib_each_way_through_one_connection() {
    // 4.4 GB in each direction (echo): both sequence spaces wrap past 2^32 at least once, with
    // an app crash and a host crash on the way. The journal holds the input once (~4.4 GB).
    let Some(_g) = lab_or_skip("seq_wrap") else { return };
    let records = 44_000_000u64;
    assert!(records * unbroken_journal::RECORD_LEN as u64 > (1u64 << 32) + (1 << 26));
    let free = fs_free_bytes(&std::env::temp_dir());
    assert!(free > 8 << 30, "seq_wrap needs 8 GiB free in {} for the journal, found {free} bytes", std::env::temp_dir().display());
    let r = check("seq_wrap", &Scenario { records, rate: 0, echo: true, crashes: vec![Crash::App, Crash::Host], timeout: Duration::from_secs(900), ..base(records) });
    assert_eq!(r.bytes_verified, 4_400_000_000);
}

fn fs_free_bytes(p: &std::path::Path) -> u64 {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return 0;
    }
    s.f_bavail as u64 * s.f_frsize as u64
}

#[test]
fn guard_on_the_application_host() {
    // Placement "local": the guard queues from OUTPUT and INPUT on the app's own host and the
    // side channel runs over loopback; injected packets to the app loop back with the guard's
    // mark and are not queued again.
    let Some(_g) = lab_or_skip("local_guard") else { return };
    let r = check("local_guard", &Scenario { crashes: vec![Crash::App, Crash::GuardAndApp, Crash::App], local_guard: true, ..base(30_000) });
    assert!(r.guard["counters"]["recovered"].as_u64().unwrap_or(0) >= 1);
}

#[test]
fn hostile_input_never_reaches_the_connection() {
    // While the peer streams (and the app crashes twice), the running guard gets garbage
    // datagrams, wrong-key, stale and replayed commands from an allowed source, correctly keyed
    // CLEARs from a source that is not allowed, and TCP with malformed options toward the
    // service. The transfer must finish byte-exact with 0 RSTs, and every refusal is counted.
    let Some(_g) = lab_or_skip("hostile") else { return };
    let r = check("hostile", &Scenario { crashes: vec![Crash::App, Crash::Host], hostile: true, ..base(30_000) });
    let c = &r.guard["counters"];
    // The side-channel datagrams go in batches the guard acknowledges (see hostile_traffic), and
    // the status is read after a write that followed the last of them: every one is counted.
    for (k, sent) in [("cmd_malformed", 2000), ("cmd_rejected_auth", 2000), ("cmd_rejected_stale", 2000), ("cmd_rejected_replay", 200), ("cmd_rejected_source", 500)] {
        assert_eq!(c[k].as_u64(), Some(sent), "{k}: {c}");
    }
    assert!(c["malformed"].as_u64().unwrap_or(0) > 0, "malformed TCP options not counted: {c}");
    // Issue 9, item 2: blind forgeries on the connection's own 4-tuple (SYN, SYN-ACK, RST, FIN,
    // ACK with random numbers, ACKs with a broken checksum) were refused or left to the app's
    // TCP, and the transfer above still finished byte-exact with 0 RSTs.
    for k in ["hostile_peer_bad_checksum", "hostile_peer_out_of_window", "peer_syn_challenged"] {
        assert!(c[k].as_u64().unwrap_or(0) > 0, "{k}: {c}");
    }
}

#[test]
fn chaos_three_trials_through_the_binary() {
    // `unbroken demo checkpoint --chaos 3 --json`: three fresh labs, one random fault each
    // (seed fixed so a failure replays), every trial byte-exact with 0 RSTs and no hang, exit 0.
    // Ignored from 2026-11-23 to issue 21 (item 1) for one hang in a fresh-clone CI run (trial
    // 1, host crash on a bulk stream: no progress for 180 s after the recovery, 0 RSTs). Not
    // reproduced since: 64 runs of this seed on the code before issue 21's fixes, 90 after, and
    // 180 random trials; a transfer that stops for 20 s now dumps both ends' sockets, the guard's
    // queue and counters to stderr (`stuck_diagnostics`), so a recurrence is diagnosable.
    let Some(_g) = lab_or_skip("chaos") else { return };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_unbroken"))
        .args(["demo", "checkpoint", "--chaos", "3", "--json", "--seed", "11"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run unbroken");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("chaos: {text}");
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("chaos JSON ({e}): {text:?}"));
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(out.status.code(), Some(0), "exit status with ok: {v}");
    assert_eq!((v["trials"].as_u64(), v["byte_exact"].as_u64(), v["resets_seen_by_client"].as_u64(), v["hangs"].as_u64(), v["seed"].as_u64()), (Some(3), Some(3), Some(0), Some(0), Some(11)), "{v}");
    let faults: u64 = v["faults"].as_object().expect("faults").values().map(|n| n.as_u64().unwrap()).sum();
    assert_eq!(faults, 3, "one fault per trial: {v}");
    let s = &v["stall_ms"];
    let (p50, p99, max) = (s["p50"].as_u64().unwrap(), s["p99"].as_u64().unwrap(), s["max"].as_u64().unwrap());
    assert!(p50 <= p99 && p99 <= max && max < 60_000, "stall_ms {s}");
}

#[test]
fn app_crashes_on_a_bulk_stream() {
    // The peer streams as fast as it can (its window full: the most bytes in flight when the
    // app dies, more than the recovered socket's first window). Byte-exact with 0 RSTs, and no
    // deadlock between an app writing its resent output and a peer whose ACKs lie beyond the
    // new socket's window (the engine brings their SEQ inside).
    let Some(_g) = lab_or_skip("bulk") else { return };
    let r = check("bulk", &Scenario { crashes: vec![Crash::App, Crash::App, Crash::App], crash_at: Some(vec![0.2, 0.45, 0.7]), rate: 0, ..base(1_500_000) });
    eprintln!("bulk: peer TCP counters {}", r.peer_tcp);
}

#[test]
fn hostile_forged_app_source_from_the_peer_side() {
    // Issue 9 item 1, the rules: an attacker on the peer's side of the gateway guard sends it
    // recovery SYNs and data segments with the service's address and port as source and the
    // live connection's peer end as destination. The guard's rules match the side they mean
    // (`app_interface`): every forged packet is dropped by the chain's DROP rule (counted by
    // its packet counter) and never reaches the guard's engine (no forged recovery SYN is seen,
    // `hostile_recovery_syn` stays 0); the live connection, recovered from an app crash after,
    // ends byte-exact with 0 RSTs.
    let Some(_g) = lab_or_skip("forged_source") else { return };
    let r = check("forged_source", &Scenario { crashes: vec![Crash::App], forge_app_source: true, ..base(30_000) });
    let c = &r.guard["counters"];
    assert_eq!(r.forged_sent, 200, "forged packets sent");
    assert_eq!(r.forged_dropped, r.forged_sent, "every forged packet dropped by the rules: {c}");
    assert_eq!(r.guard["forged_source_dropped"].as_u64(), Some(r.forged_sent), "the guard's status counts them: {}", r.guard);
    assert_eq!(c["hostile_recovery_syn"].as_u64(), Some(0), "a forged SYN reached the guard: {c}");
    assert!(c["recovered"].as_u64().unwrap_or(0) >= 1, "{c}");
}

// Issue 9, checkpoint misconfiguration: the journal server given a wrong key or a wrong guard
// address says so at start-up and for each connection, and the peer sees the close (as without
// the guard) instead of hanging; with the right key the connection stays protected. Issue 21,
// item 8: after the failed start-up check the SDK asks the guard nothing for a new connection
// ("not asked"), so the close comes at once, and it is a FIN although the peer's input was never
// read ("eof", not a reset: the server declines the connection with `unbroken_sdk::decline`).
// Before, each connection waited out the side channel's retries (3.2 s) and was reset.

fn misconfigured(name: &str, m: Misconfig) -> MisconfigReport {
    let r = run_misconfigured(m).unwrap_or_else(|e| panic!("{name}: {e}"));
    eprintln!("{name}: peer {} after {} ms; {}; {}", r.peer, r.peer_ms, r.guard_check, r.listening);
    eprintln!("{name}: app log: {}", r.app_log);
    eprintln!("{name}: guard counters {}", r.guard["counters"]);
    r
}

/// Issue 21, item 4, with real kernels: the guard restarts between the peer's handshake and the
/// application's first TELL (the application stopped at `accepted` meanwhile; the peer has sent
/// input, whose retransmission makes the new guard reset the application's socket before the
/// application looks at it). Nobody knows the checkpoint, so the connection cannot be
/// protected; `establish` still names the reset connection (SO_PEERNAME), gives up with
/// ABANDON, and the new guard releases the connection and resets the peer at once. Before, the
/// peer hung until its own timeout.
#[test]
fn guard_restart_before_the_first_tell_ends_the_connection_visibly_in_the_lab() {
    let Some(_g) = lab_or_skip("restart_before_tell") else { return };
    let r = misconfigured("restart_before_tell", Misconfig::GuardRestartBeforeFirstTell);
    assert!(r.peer.starts_with("reset"), "the peer is reset, not {} after {} ms", r.peer, r.peer_ms);
    assert!(r.peer_ms < 15_000, "{} after {} ms", r.peer, r.peer_ms);
    assert!(r.app_log.contains("not protected, closing"), "{}", r.app_log);
    let c = &r.guard["counters"];
    assert_eq!((c["abandoned_released"].as_u64(), c["abandoned_peer_reset"].as_u64()), (Some(1), Some(1)), "{c}");
}

#[test]
fn hostile_journal_with_a_wrong_key_says_so_and_the_peer_sees_the_close() {
    let Some(_g) = lab_or_skip("wrong_key") else { return };
    let r = misconfigured("wrong_key", Misconfig::WrongKey);
    assert!(r.guard_check.contains("FAILED") && r.guard_check.contains("key"), "start-up: {}", r.guard_check);
    assert!(r.listening.contains("UNPROTECTED"), "{}", r.listening);
    assert!(r.app_log.contains("not protected, closing") && r.app_log.contains("rejected the side-channel key"), "per connection: {}", r.app_log);
    assert!(r.app_log.contains("not asked"), "no command for the connection after the failed check: {}", r.app_log);
    assert_eq!(r.peer, "eof", "the peer sees the server's FIN, within {} ms", r.peer_wait_ms);
    let c = &r.guard["counters"];
    // The probe's (one, or more if an answer was slower than the 50 ms first wait).
    assert!(c["naks_sent"].as_u64().unwrap_or(0) >= 1, "{c}");
    assert_eq!(c["unprotected_released"].as_u64(), Some(1), "{c}");
}

#[test]
fn hostile_journal_with_a_wrong_guard_address_says_so_and_the_peer_sees_the_close() {
    let Some(_g) = lab_or_skip("wrong_guard") else { return };
    let r = misconfigured("wrong_guard", Misconfig::WrongGuardAddress);
    assert!(r.guard_check.contains("FAILED") && r.guard_check.contains("nothing answered"), "start-up: {}", r.guard_check);
    assert!(r.app_log.contains("not protected, closing") && r.app_log.contains("nothing answered"), "per connection: {}", r.app_log);
    assert!(r.app_log.contains("not asked"), "no retries for the connection after the failed check: {}", r.app_log);
    assert_eq!(r.peer, "eof", "the peer sees the server's FIN, within {} ms", r.peer_wait_ms);
    // A sanity bound only (the log above shows the path): nowhere near the 3.2 s of retries.
    assert!(r.peer_ms < 2500, "the close took {} ms", r.peer_ms);
    assert_eq!(r.guard["counters"]["unprotected_released"].as_u64(), Some(1), "{}", r.guard["counters"]);
}

#[test]
fn hostile_journal_control_run_with_the_right_key_stays_protected() {
    let Some(_g) = lab_or_skip("right_key") else { return };
    let r = misconfigured("right_key", Misconfig::None);
    assert!(r.guard_check.contains("guard check: ok"), "{}", r.guard_check);
    assert!(!r.listening.contains("UNPROTECTED"), "{}", r.listening);
    assert!(r.app_log.contains("connected and protected"), "{}", r.app_log);
    assert_eq!(r.peer, "protected");
    let c = &r.guard["counters"];
    assert_eq!((c["unprotected_released"].as_u64(), c["naks_sent"].as_u64()), (Some(0), Some(0)), "{c}");
}

#[test]
fn hostile_journal_behind_a_one_way_side_channel_lets_the_peer_see_the_close() {
    // The guard's answers never reach the application (a firewall passes only its outgoing
    // UDP): its TELLs arrive, it gives up for want of an answer and closes (since issue 21 the
    // start-up probe's TELLs are the only ones: the connection is closed without asking). A TELL does not
    // claim the connection, so the unprotected mark releases it; the SDK's SHUTDOWN, posted
    // when it gives up, makes the FIN genuine as well. Before: the guard took the TELL as a
    // claim, refused the mark and turned the FIN into a RST for the application: the peer hung.
    let Some(_g) = lab_or_skip("one_way") else { return };
    let r = misconfigured("one_way", Misconfig::OneWaySideChannel);
    assert!(r.guard_check.contains("FAILED") && r.guard_check.contains("nothing answered"), "start-up: {}", r.guard_check);
    assert!(r.app_log.contains("not protected, closing"), "per connection: {}", r.app_log);
    assert_eq!(r.peer, "eof", "the peer sees the server's FIN, within {} ms", r.peer_wait_ms);
    let c = &r.guard["counters"];
    // The start-up probe's TELLs reached the guard (answered "no such connection", answers
    // dropped); after that failed check the SDK sent nothing for the connection (issue 21).
    assert_eq!((c["commands"].as_u64(), c["cmd_no_connection"].as_u64()), (Some(6), Some(6)), "the probe's 6 TELLs only (none for the connection): {c}");
    assert!(r.app_log.contains("not asked"), "{}", r.app_log);
    assert_eq!(c["hostile_unprotect_refused"].as_u64(), Some(0), "{c}");
    assert_eq!(c["spurious_fin_reset"].as_u64(), Some(0), "{c}");
}
