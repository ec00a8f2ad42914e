//! `unbroken replica`'s configuration: the example loads, and each mistake is one precise error.

use unbroken_control::replica::daemon::{check_fence_command, Replica};

fn example() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/replica.example.toml"))
        .unwrap()
        .replace("key_file = \"/etc/unbroken/replica.key\"", "key = \"00112233445566778899aabbccddeeff\"")
}

fn err(edit: impl Fn(String) -> String) -> String {
    match Replica::from_toml(&edit(example())) {
        Ok(_) => panic!("accepted"),
        Err(e) => e,
    }
}

#[test]
fn the_example_loads_with_its_defaults() {
    let c = Replica::from_toml(&example()).expect("example");
    let s = c.settings();
    assert_eq!((s.detector.interval_ms, s.detector.misses, s.engine.strict, s.engine.max_hang_ms), (10, 10, true, 150));
    // 0 turns the hang rule off.
    let off = Replica::from_toml(&example().replace("max_hang_ms = 150", "max_hang_ms = 0")).expect("max_hang_ms = 0");
    assert_eq!(off.settings().engine.max_hang_ms, 0);
    assert_eq!(c.addr.to_string(), "10.77.3.10");
    // The fast path (issue 22 item 4) is off unless asked for.
    assert!(!c.raw.replica.fast_path);
    let on = Replica::from_toml(&example().replace("fast_path = false", "fast_path = true")).expect("fast_path = true");
    assert!(on.raw.replica.fast_path);
}

#[test]
fn each_mistake_is_a_precise_error() {
    let cases: Vec<(Box<dyn Fn(String) -> String>, &str)> = vec![
        (Box::new(|s| s.replace("role = \"primary\"", "role = \"master\"")), "role"),
        (Box::new(|s| s.replace("fence_command = [\"/usr/local/sbin/fence-peer\"]", "")), "fence_command is required"),
        (Box::new(|s| s.replace("fence_command = [\"/usr/local/sbin/fence-peer\"]", "fence_command = []")), "fence_command is required"),
        (Box::new(|s| s.replace("peer = \"10.77.3.12:7790\"", "peer = \"10.77.3.11:7790\"")), "own listen address"),
        (Box::new(|s| s.replace("peer = \"10.77.3.12:7790\"", "peer = \"10.77.3.10:7790\"")), "not the service address"),
        (Box::new(|s| s.replace("heartbeat_interval_ms = 10", "heartbeat_interval_ms = 0")), "heartbeat_interval_ms = 0"),
        (Box::new(|s| s.replace("missed_beats = 10", "missed_beats = 0")), "missed_beats = 0"),
        (Box::new(|s| s.replace("addr = \"10.77.3.10\"", "addr = \"fd77::10\"")), "IPv6 is not supported"),
        (Box::new(|s| s + "\n[[service]]\naddr = \"10.77.3.20\"\nport = 80\n"), "one service address"),
        (Box::new(|s| s.replace("key = \"00112233445566778899aabbccddeeff\"", "")), "exactly one of replica.key"),
        (Box::new(|s| s.replace("key = \"00112233445566778899aabbccddeeff\"", "key = \"xyz\"")), "replica.key"),
        (Box::new(|s| s.replace("interface = \"eth0\"", "interface = \"a very long name!\"")), "replica.interface"),
        (Box::new(|s| s.replace("max_connections = 65536", "max_connections = 0")), "max_connections = 0"),
        (Box::new(|s| s.replace("strict = true", "strict = true\nstrictt = 1")), "unknown field"),
        (Box::new(|s| s.replace("max_lag_ms = 5000", "max_lag_ms = 0")), "max_lag_ms = 0"),
        (Box::new(|s| s.replace("max_hang_ms = 150", "max_hang_ms = 10")), "max_hang_ms = 10: 0 (off) or 40 to 60000"),
        (Box::new(|s| s.replace("max_hang_ms = 150", "max_hang_ms = 60001")), "max_hang_ms = 60001"),
    ];
    for (i, (edit, want)) in cases.iter().enumerate() {
        let e = err(edit);
        assert!(e.contains(want), "case {i}: {e:?} should say {want:?}");
    }
}

/// Issue 20 item 7: without the two detector keys, the defaults are the example's (10 ms x 10:
/// 100 ms of silence), not 30 ms that a loaded host misses with no fault.
#[test]
fn the_detector_defaults_tolerate_a_loaded_host() {
    let text = example().replace("heartbeat_interval_ms = 10", "").replace("missed_beats = 10", "");
    let s = Replica::from_toml(&text).unwrap().settings();
    assert_eq!((s.detector.interval_ms, s.detector.misses), (10, 10));
}

fn argv(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Issue 20 item 15: a fencing command that cannot run is a start-up error naming it (found
/// when the peer dies, it is an outage); one that fences nothing gets a loud warning.
#[test]
fn hostile_fence_command_missing_or_not_executable_is_a_start_up_error() {
    let dir = std::env::temp_dir().join(format!("unbroken-fence-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plain = dir.join("fence-peer");
    std::fs::write(&plain, "#!/bin/sh\nexit 0\n").unwrap();
    let e = check_fence_command(&argv(&[plain.to_str().unwrap()])).unwrap_err();
    assert!(e.contains("not executable") && e.contains("fence-peer"), "{e}");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(check_fence_command(&argv(&[plain.to_str().unwrap(), "10.77.3.12"])), Ok(None));
    let e = check_fence_command(&argv(&["/nonexistent/fence-peer"])).unwrap_err();
    assert!(e.contains("/nonexistent/fence-peer") && e.contains("No such file"), "{e}");
    let e = check_fence_command(&argv(&["no-such-fence-command-anywhere"])).unwrap_err();
    assert!(e.contains("not found in PATH"), "{e}");
    let e = check_fence_command(&argv(&[dir.to_str().unwrap()])).unwrap_err();
    assert!(e.contains("not a file"), "{e}");
    assert!(check_fence_command(&argv(&[])).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
    // Resolved through PATH like the command itself (sh is everywhere).
    assert_eq!(check_fence_command(&argv(&["sh", "-c", "exit 0"])), Ok(None));
}

#[test]
fn fence_command_true_gets_a_loud_warning() {
    for a in [&["true"][..], &["/bin/true"], &["true", "x"]] {
        let w = check_fence_command(&argv(a)).unwrap().expect("a warning");
        assert!(w.contains("WARNING") && w.contains("fences nothing"), "{w}");
    }
}
