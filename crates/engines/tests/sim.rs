//! Deterministic simulation of the RTCP engine between two real (userspace) TCP stacks: the
//! bare `rtcp::incoming`/`outgoing`/`command` functions on one `Conn` as the filter between the
//! protected application *A* and its unmodified peer *B*. The harness (model, faults, invariants,
//! `SIM_SCALE`, `SIM_VERBOSE`, `SIM_TRACE`) is `rtcp_sim/mod.rs`, shared with the guard's
//! simulation (`crates/control/tests/guard_sim.rs`), which runs the same application and peer
//! through the whole `guard::Core`.

mod rtcp_sim;

use rtcp_sim::*;

fn try_run(sc: Scenario) -> Result<Report, String> {
    try_run_on::<EngineFilter>(sc)
}
fn run(sc: Scenario) -> Report {
    run_on::<EngineFilter>(sc)
}
fn baseline(sc: &Scenario) -> Report {
    baseline_on::<EngineFilter>(sc)
}
fn sweep(name: &str, base: Scenario, allow_lost: bool, f: impl Fn(&mut Scenario, u64)) -> Vec<Report> {
    sweep_on::<EngineFilter>(name, base, allow_lost, f)
}
fn middle_packet(sc: &Scenario) -> u64 {
    middle_packet_on::<EngineFilter>(sc)
}


// ---------------------------------------------------------------------------------------------
// 1. No crash
// ---------------------------------------------------------------------------------------------

/// I1-I4 / O1-O9 in the common case: checkpointed acknowledgments, no fault.
#[test]
fn common_case_clean_link() {
    let r = run(Scenario::new("clean", 1, 200_000 * scale()));
    assert_eq!((r.crashes, r.recoveries_completed, r.resets_seen), (0, 0, 0));
    assert!(r.events.is_empty(), "no engine event expected: {:?}", r.events);
    assert!(!r.b_stuck_in_last_ack);
    assert!(r.virtual_ms < 20_000, "{r:?}");
}

/// The same with 2% loss, reordering and duplication on the wide link, several seeds.
#[test]
fn common_case_lossy_link() {
    for seed in 0..(6 * scale() as u64) {
        let r = run(Scenario::new(&format!("lossy-{seed}"), 100 + seed, 200_000 * scale()).lossy(0.02, 0.01, 0.02));
        assert_eq!(r.crashes + r.resets_seen, 0, "{r:?}");
        assert!(r.events.is_empty(), "no engine event expected: {:?}", r.events);
    }
}

// ---------------------------------------------------------------------------------------------
// 2. A crash at every packet position (O4/O5, section 4)
// ---------------------------------------------------------------------------------------------

/// O5: a crash of *A* after every single packet of a transfer (handshake and close included);
/// *A* recovers as section 4 says, the recovery SYN is answered at once from ackB.
#[test]
fn o5_recovery_syn_answered_at_every_packet() {
    let reps = sweep("o5-every-packet", Scenario::new("", 7, 30_000), false, |sc, k| sc.crash_after = vec![k]);
    let crashed = reps.iter().filter(|r| r.crashes == 1).count();
    assert!(crashed + 3 >= reps.len(), "most positions must really crash A ({crashed}/{})", reps.len());
    assert!(reps.iter().all(|r| r.crashes == 0 || r.recoveries_completed == 1 || r.virtual_ms > 0));
    assert!(reps.iter().map(|r| r.count(Event::Recovered)).sum::<u32>() > 0);
    assert!(reps.iter().any(|r| r.pre_accept_recoveries > 0), "a crash inside the handshake");
    assert!(reps.iter().any(|r| r.delivered_at_recovery.iter().any(|&d| d > 0)), "a crash after some output");
}

/// Crashes inside the handshake, restarting at once (before B's ACK of the SYN-ACK reaches the
/// filter), with RTCP_ADOPT as the guard offers it (connections whose handshake completed, or
/// whose SYN-ACK went out: ackB0 is its SEQ + 1; the record is taken from ADOPT's answer) and as
/// the simulated application uses it by default (as soon as the guard saw B's SYN, ackB0 from
/// the TELL). Before issue 21 item 3 the guard's rule offered only completed handshakes and lost
/// the connection at the first positions; now no position may lose it.
#[test]
fn adopt_after_crash_inside_handshake() {
    for guard_rule in [false, true] {
        let mut base = Scenario::new("", 31, 10_000);
        base.restart_delay_ms = 0;
        base.adopt_needs_recoverable = guard_rule;
        base.max_virtual = Duration::from_secs(60);
        let first_tell = baseline(&base).first_tell_at.unwrap();
        let mut lost = vec![];
        let mut adopted = 0;
        for k in 1..=first_tell + 2 {
            let mut sc = base.clone();
            sc.name = format!("adopt guard_rule={guard_rule} k={k}");
            sc.crash_after = vec![k];
            sc.stall_is_err = true;
            match try_run(sc) {
                Ok(r) => adopted += r.pre_accept_recoveries,
                Err(e) => lost.push((k, e)),
            }
        }
        assert!(lost.is_empty(), "ADOPT guard_rule={guard_rule} lost the connection at {lost:?} of 1..={}", first_tell + 2);
        assert!(adopted >= 2, "crashes before accept adopted (guard_rule={guard_rule}): {adopted}");
    }
}

/// The same with a lossy link (each position with its own seed; `SIM_SCALE` seeds each).
#[test]
fn o5_recovery_at_every_packet_lossy() {
    for round in 0..scale() as u64 {
        sweep(&format!("o5-every-packet-lossy round {round}"), Scenario::new("", 17 + round, 20_000).lossy(0.02, 0.01, 0.02), false, |sc, k| {
            sc.crash_after = vec![k];
            sc.seed = 1000 + 100_000 * round + k;
        });
    }
}

/// Section 4's TELL comes a little after the reconnection (the application is not instant, and
/// the side channel is a round trip). Meanwhile *B*'s acknowledgments of output the dead
/// incarnation had sent keep arriving: the TELL must still name the point where the new
/// socket's stream begins (the SYN-ACK's ackB), or *A* resumes its output at the wrong place.
#[test]
fn o5_tell_after_peer_acknowledged_more() {
    // With CloseOnExit the dead process's kernel even keeps sending its output meanwhile.
    for mode in [CrashMode::Wipe, CrashMode::CloseOnExit] {
        for (restart, tell) in [(0, 3), (0, 12), (2, 25)] {
            let mut base = Scenario::new("", 21, 20_000);
            base.crash_modes = vec![mode];
            base.restart_delay_ms = restart;
            base.tell_delay_ms = tell;
            sweep(&format!("o5-late-tell {mode:?} restart={restart} tell={tell}"), base, false, |sc, k| sc.crash_after = vec![k]);
        }
    }
}

/// Acknowledgments of the dead incarnation's output can arrive after the TELL (the origin
/// stops following ackB there). Here the dead process's kernel had sent all output and its
/// (genuine, after SHUTDOWN) FIN; B's ACK of that FIN reaches the filter after the TELL. The
/// new socket resends the output, and B acknowledges up to the old FIN + 1, one beyond anything
/// the new socket sent. *A*'s TCP discards such an ACK (RFC 793 3.9): an application that waits
/// for its output to be acknowledged before close() (`close_after_acks`) waited forever (issue
/// 21, item 2; this test was `known_gap_peer_acks_old_fin_after_tell`, ignored). The engine now
/// lowers B's ACK to the end of what the current socket sent (`Conn::a_end`), checked exactly by
/// the harness at every packet; the runs must complete.
#[test]
fn peer_acks_of_an_old_fin_after_tell_are_clamped() {
    let mut base = Scenario::new("", 21, 20_000);
    base.crash_modes = vec![CrashMode::CloseOnExit];
    base.restart_delay_ms = 0;
    base.tell_delay_ms = 3;
    base.close_after_acks = Some(true);
    let reps = sweep("old-fin-acked", base, false, |sc, k| sc.crash_after = vec![k]);
    let clamped: Vec<usize> = reps.iter().enumerate().filter(|(_, r)| r.peer_acks_clamped > 0).map(|(i, _)| i + 1).collect();
    eprintln!("old-fin-acked: B's ACKs lowered at positions {clamped:?}");
    assert!(!clamped.is_empty(), "the sweep must reach the case: B acknowledging beyond what A's new socket sent");
}

/// Section 2.4.2: the process dies but its kernel survives and closes the socket; O6 turns the
/// spurious FIN into a RST for *A*, O1 drops *A*'s RSTs, and the restarted process recovers on
/// the same stack.
#[test]
fn s2_4_spurious_fin_on_exit_at_every_packet() {
    let mut base = Scenario::new("", 8, 20_000);
    base.crash_modes = vec![CrashMode::CloseOnExit];
    let reps = sweep("s2.4-close-on-exit", base, false, |sc, k| sc.crash_after = vec![k]);
    assert!(reps.iter().map(|r| r.count(Event::SpuriousFinReset)).sum::<u32>() > 0);
}

/// Section 2.4.2's race: *A* sends RTCP_SHUTDOWN once its last send() returned (its output
/// may still be in flight), dies, recovers, and dies again before it re-enqueued its output; its
/// kernel's FIN must again be taken for spurious (O5 forgets FIN_ALLOWED), or *B* would see the
/// end of the stream before the rest of the output.
#[test]
fn s2_4_shutdown_then_crash_twice_at_every_packet() {
    // First death: the process (its kernel sends what it holds, then a FIN), or the whole host
    // (what was not on the wire is lost); second death, right after reconnecting: the process.
    // `wait`: the application lingers between RTCP_SHUTDOWN and close() (here: until its output
    // is acknowledged), which keeps the window for the race open.
    for (name, modes, loss, per_k_seed, wait) in [
        ("exit+exit", vec![CrashMode::CloseOnExit], 0.0, false, None),
        ("exit+exit-seeds", vec![CrashMode::CloseOnExit], 0.0, true, None),
        ("host+exit", vec![CrashMode::Silent, CrashMode::CloseOnExit], 0.0, true, Some(true)),
        ("exit+exit-lossy", vec![CrashMode::CloseOnExit], 0.05, true, None),
    ] {
        let mut base = Scenario::new("", 10, 20_000).lossy(loss, 0.0, 0.0);
        base.close_after_acks = wait;
        base.crash_modes = modes;
        base.crash_on_reconnect = 1;
        base.restart_delay_ms = 1;
        let reps = sweep(&format!("s2.4-shutdown-crash-twice {name}"), base, false, |sc, k| {
            sc.crash_after = vec![k];
            if per_k_seed {
                sc.seed = 3000 + k;
            }
        });
        assert!(reps.iter().filter(|r| r.crashes == 2).count() > 10);
    }
}

/// A machine that is silent while down (nothing answers *B*) at every packet position.
#[test]
fn o5_silent_host_at_every_packet() {
    let mut base = Scenario::new("", 9, 20_000);
    base.crash_modes = vec![CrashMode::Silent];
    base.restart_delay_ms = 200;
    sweep("silent-host", base, false, |sc, k| sc.crash_after = vec![k]);
}

// ---------------------------------------------------------------------------------------------
// 3. Repeated crashes with loss
// ---------------------------------------------------------------------------------------------

#[test]
fn s4_repeated_crashes_with_loss() {
    let s = scale() as u64;
    for seed in 0..(6 * s) {
        let mut sc = Scenario::new(&format!("repeated-{seed}"), 200 + seed, 120_000 * s as usize).lossy(0.02, 0.01, 0.02);
        let mut rng = Rng::new(seed);
        let n = 3 + rng.below(3) as usize;
        let mut ks: Vec<usize> = (0..n).map(|_| 1 + rng.below(sc.payload as u64 * 9 / 10) as usize).collect();
        ks.sort();
        sc.crash_at_input = ks;
        sc.crash_modes = vec![CrashMode::Wipe, CrashMode::CloseOnExit, CrashMode::Silent];
        sc.restart_delay_ms = rng.below(200);
        let r = run(sc);
        assert_eq!(r.crashes as usize, n, "{r:?}");
        assert!(r.recoveries_completed >= 1, "{r:?}");
    }
}

/// A's window scale changes across crashes (its receive buffer differs per incarnation), in
/// both directions: the engine rescales A's window to the shift B still applies, so B is never
/// promised more than A's socket offers, and the window does not collapse either.
#[test]
fn window_scale_changes_across_crashes() {
    for (i, rx) in [vec![65535, 256 * 1024, 32 * 1024, 1024 * 1024], vec![1024 * 1024, 65535, 128 * 1024, 16 * 1024]].into_iter().enumerate() {
        let mut sc = Scenario::new(&format!("wscale-{i}"), 300 + i as u64, 200_000);
        sc.a_rx = rx;
        sc.check_window = true;
        sc.crash_at_input = spread_input(&sc, 3);
        let r = run(sc);
        assert_eq!((r.crashes, r.recoveries_completed), (3, 3), "{r:?}");
    }
}

/// O7 with a slow application: its TCP holds data the application has not consumed (O7 keeps
/// it unacknowledged, the window keeps A's right edge), while the application keeps writing;
/// with crashes, and with the window-scale change.
#[test]
fn o7_slow_reader_with_crashes() {
    for (i, (rate, rx)) in [(20usize, vec![65535usize]), (50, vec![256 * 1024, 65535, 1024 * 1024])].into_iter().enumerate() {
        for lossy in [false, true] {
            let mut sc = Scenario::new(&format!("slow-reader-{i} lossy={lossy}"), 310 + i as u64, 100_000);
            if lossy {
                sc = sc.lossy(0.02, 0.01, 0.02);
            }
            sc.read_rate = Some(rate);
            sc.a_rx = rx.clone();
            sc.check_window = true;
            sc.crash_at_input = spread_input(&sc, 2);
            let r = run(sc);
            assert_eq!(r.crashes, 2, "{r:?}");
            assert!(r.acks_held_back > 50, "O7 must have held data back: {r:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. The filter restarting (section 2.7)
// ---------------------------------------------------------------------------------------------

/// The filter loses its state alone: A's next packet becomes a RST for A (O6), A recovers with
/// ACKNOWLEDGE before its SYN.
#[test]
fn s2_7_filter_restart_at_every_packet() {
    let reps = sweep("s2.7-filter-restart", Scenario::new("", 11, 20_000), true, |sc, k| sc.filter_restart_after = vec![k]);
    assert!(reps.iter().map(|r| r.count(Event::NoCheckpointReset)).sum::<u32>() > 0);
    assert!(reps.iter().map(|r| r.resets_seen).sum::<u32>() > 0);
}

/// The filter restarting at every position of a lossy transfer, alone and with A.
#[test]
fn s2_7_filter_restart_at_every_packet_lossy() {
    for round in 0..scale() as u64 {
        for with_app in [false, true] {
            let base = Scenario::new("", 40 + round, 20_000).lossy(0.02, 0.01, 0.02);
            sweep(&format!("s2.7-lossy app={with_app} round {round}"), base, true, |sc, k| {
                sc.filter_restart_after = vec![k];
                if with_app {
                    sc.crash_after = vec![k];
                }
                sc.seed = 2000 + 100_000 * round + k;
            });
        }
    }
}

/// The filter and A fail at the same moment: A's recovery is the filter's too. With an
/// immediate restart, A's recovery SYN usually reaches the filter before any packet from B has:
/// O4 forwards it and B's (challenge) ACK becomes the SYN-ACK (section 6).
#[test]
fn s2_7_filter_restart_with_app_crash_at_every_packet() {
    let mut forwarded = 0;
    let mut from_peer = 0;
    for delay in [0, 30] {
        let mut base = Scenario::new("", 12, 20_000);
        base.restart_delay_ms = delay;
        let reps = sweep(&format!("s2.7-filter+app delay={delay}"), base, true, |sc, k| {
            sc.crash_after = vec![k];
            sc.filter_restart_after = vec![k];
        });
        forwarded += reps.iter().map(|r| r.count(Event::RecoverySynForwarded)).sum::<u32>();
        from_peer += reps.iter().map(|r| r.count(Event::RecoveredFromPeerAck)).sum::<u32>();
    }
    assert!(forwarded > 0 && from_peer > 0, "section 6 path exercised: forwarded={forwarded} from_peer={from_peer}");
}

/// Filter restarts and crashes at random moments of a lossy transfer.
#[test]
fn s2_7_filter_restarts_and_crashes_with_loss() {
    let s = scale() as u64;
    for seed in 0..(4 * s) {
        let mut sc = Scenario::new(&format!("s2.7-lossy-{seed}"), 400 + seed, 80_000 * s as usize).lossy(0.02, 0.01, 0.02);
        let total = baseline(&sc).packets;
        let mut rng = Rng::new(seed + 77);
        let k1 = total / 10 + rng.below(total / 3);
        let k2 = total / 2 + rng.below(total / 3);
        sc.filter_restart_after = vec![k1, k2];
        sc.crash_after = vec![k2];
        sc.crash_modes = vec![CrashMode::Wipe, CrashMode::Silent];
        run(sc);
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Timestamps (PAWS)
// ---------------------------------------------------------------------------------------------

/// A's new socket after a crash has a clock 2^30 ms behind the old one (and the clocks sit near
/// the 2^32 wrap): without the engine's offset, B's PAWS would drop everything A sends.
#[test]
fn paws_new_clock_after_crash() {
    for (i, lossy) in [(0u64, false), (1, true), (2, true)] {
        let mut sc = Scenario::new(&format!("paws-{i}"), 500 + i, 150_000);
        if lossy {
            sc = sc.lossy(0.02, 0.0, 0.0);
        }
        sc.timestamps = true;
        sc.b_ts_base = u32::MAX - 3_000;
        let first = u32::MAX - 10_000; // wraps during the run
        sc.a_ts_bases = vec![first, first.wrapping_sub(1 << 30), first.wrapping_add(1 << 31), first.wrapping_sub(12_345)];
        sc.crash_at_input = spread_input(&sc, 3);
        sc.crash_modes = vec![CrashMode::Wipe, CrashMode::Silent, CrashMode::Wipe];
        let r = run(sc);
        assert_eq!((r.crashes, r.recoveries_completed), (3, 3), "{r:?}");
        assert!(r.raw_clock_behind_peer >= 2, "the new clocks must really be behind: {r:?}");
        // Reordering is off, so no TSval may ever go backwards for B, let alone by a clock jump.
        assert_eq!(r.paws_drops, 0, "PAWS dropped A's packets: {r:?}");
        assert!(r.max_stall_ms < 5_000, "{r:?}");
    }
}

/// Filter restart with timestamps: the restarted filter does not know A's old clock; the
/// recovery must still not trip PAWS badly enough to stall.
#[test]
fn paws_filter_restart_with_app_crash() {
    let mut sc = Scenario::new("paws-filter", 510, 100_000);
    sc.timestamps = true;
    sc.a_ts_bases = vec![1_000_000, 5];
    sc.crash_after = vec![middle_packet(&sc)];
    sc.filter_restart_after = sc.crash_after.clone();
    let r = run(sc);
    assert!(r.max_stall_ms < 5_000, "{r:?}");
}

/// Timestamps, the filter and A failing together at every packet position, A restarting at once
/// (section 6 path): the restarted filter relearns A's old clock from B's TSecr.
#[test]
fn paws_filter_restart_with_app_crash_at_every_packet() {
    let mut base = Scenario::new("", 530, 20_000);
    base.timestamps = true;
    base.restart_delay_ms = 0;
    base.a_ts_bases = vec![2_000_000_000, 7];
    let reps = sweep("paws-filter+app", base, true, |sc, k| {
        sc.crash_after = vec![k];
        sc.filter_restart_after = vec![k];
    });
    assert!(reps.iter().map(|r| r.raw_clock_behind_peer).sum::<u32>() > 10);
    for r in &reps {
        assert_eq!(r.paws_drops, 0, "{r:?}");
    }
}

/// Timestamps on a lossy, reordering, duplicating link with repeated crashes and a filter
/// restart: reordering makes B's PAWS drop a few stale segments (as Linux would), but never one
/// that is behind by a clock jump.
#[test]
fn paws_lossy_reordered_repeated_crashes() {
    for seed in 0..(4 * scale() as u64) {
        let mut sc = Scenario::new(&format!("paws-lossy-{seed}"), 540 + seed, 100_000).lossy(0.02, 0.01, 0.02);
        sc.timestamps = true;
        let mut rng = Rng::new(seed);
        sc.a_ts_bases = (0..5).map(|_| rng.next() as u32).collect();
        sc.crash_at_input = spread_input(&sc, 3);
        sc.crash_modes = vec![CrashMode::Wipe, CrashMode::CloseOnExit, CrashMode::Silent];
        sc.filter_restart_after = vec![baseline(&sc).packets / 3];
        let r = run(sc);
        assert!(r.paws_max_regression < 1_000, "a TSval jumped backwards: {r:?}");
    }
}

/// Timestamps with every crash position of a small transfer.
#[test]
fn paws_crash_at_every_packet() {
    let mut base = Scenario::new("", 520, 20_000);
    base.timestamps = true;
    base.a_ts_bases = vec![3_000_000_000, 100, 4_000_000_000];
    let reps = sweep("paws-every-packet", base, false, |sc, k| sc.crash_after = vec![k]);
    for r in &reps {
        assert_eq!(r.paws_drops, 0, "{r:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Sequence numbers crossing 2^32
// ---------------------------------------------------------------------------------------------

/// ISNs just below 2^32 on both sides (and for A's recovered sockets): Δ, ackA0 + consumed and
/// ackB - ackB0 all cross the wrap.
#[test]
fn seq_wrap_across_2_32() {
    let a0 = u32::MAX - 4_000; // A's output (37% of 60 KB) crosses 2^32 early
    let b0 = u32::MAX - 20_000; // B's input crosses 2^32 a third of the way in
    let mut sc = Scenario::new("wrap", 600, 60_000);
    sc.a_seeds = vec![seed_for_isn(a0), seed_for_isn(u32::MAX - 10), seed_for_isn(u32::MAX)];
    sc.b_seed = Some(seed_for_isn(b0));
    sc.crash_at_input = spread_input(&sc, 2);
    let r = run(sc.clone());
    assert_eq!(r.a_isn_first, Some(a0), "smoltcp's ISN draw changed: fix seed_for_isn");
    assert_eq!(r.b_isn, Some(b0), "smoltcp's ISN draw changed: fix seed_for_isn");
    assert_eq!(r.recoveries_completed, 2);
    assert!(r.delivered_at_recovery.iter().any(|&d| a0 as u64 + 1 + d > 1 << 32), "delivered crosses the wrap: {r:?}");

    // And every crash position around the wrap.
    let mut base = sc;
    base.payload = 20_000;
    base.crash_at_input.clear();
    sweep("wrap-every-packet", base, false, |sc, k| sc.crash_after = vec![k]);
}
