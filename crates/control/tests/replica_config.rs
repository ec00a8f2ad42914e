//! `unbroken replica`'s configuration: the example loads, and each mistake is one precise error.

use unbroken_control::replica::Replica;

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
    assert_eq!((s.detector.interval_ms, s.detector.misses, s.engine.strict), (10, 3, true));
    assert_eq!(c.addr.to_string(), "10.77.3.10");
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
        (Box::new(|s| s.replace("missed_beats = 3", "missed_beats = 0")), "missed_beats = 0"),
        (Box::new(|s| s.replace("addr = \"10.77.3.10\"", "addr = \"fd77::10\"")), "IPv6 is not supported"),
        (Box::new(|s| s + "\n[[service]]\naddr = \"10.77.3.20\"\nport = 80\n"), "one service address"),
        (Box::new(|s| s.replace("key = \"00112233445566778899aabbccddeeff\"", "")), "exactly one of replica.key"),
        (Box::new(|s| s.replace("key = \"00112233445566778899aabbccddeeff\"", "key = \"xyz\"")), "replica.key"),
        (Box::new(|s| s.replace("interface = \"eth0\"", "interface = \"a very long name!\"")), "replica.interface"),
        (Box::new(|s| s.replace("max_connections = 65536", "max_connections = 0")), "max_connections = 0"),
        (Box::new(|s| s.replace("strict = true", "strict = true\nstrictt = 1")), "unknown field"),
        (Box::new(|s| s.replace("max_lag_ms = 5000", "max_lag_ms = 0")), "max_lag_ms = 0"),
    ];
    for (i, (edit, want)) in cases.iter().enumerate() {
        let e = err(edit);
        assert!(e.contains(want), "case {i}: {e:?} should say {want:?}");
    }
}
