//! The agent's configuration refuses out-of-range numbers with an error naming the field
//! (issue 9, item 11): no value read from it can overflow the arithmetic done on it later
//! (`ttl_s * 1000 / 3`, durations in milliseconds).

use unbroken_control::object::agent::Agent;

const GOOD: &str = r#"
[agent]
server_id = 1
services = ["10.77.0.100:80"]
failover_gate = "open"

[store]
nodes = ["127.0.0.1:6379"]
record_key = "8f1e2d3c4b5a69788796a5b4c3d2e1f0"
"#;

#[test]
fn hostile_huge_numbers_in_the_agent_config() {
    let a = Agent::from_toml(GOOD).expect("the good config");
    assert_eq!(a.raw.store.ttl_s, 600);
    let huge = "9223372036854775807";
    for (section, field, value, want) in [
        ("[agent]", "heartbeat_interval_ms", huge, "agent.heartbeat_interval_ms"),
        ("[agent]", "wedged_after_ms", huge, "agent.wedged_after_ms"),
        ("[agent]", "wedged_after_ms", "0", "agent.wedged_after_ms"),
        ("[store]", "timeout_ms", huge, "store.timeout_ms"),
        ("[store]", "ttl_s", huge, "store.ttl_s"),
        ("[store]", "ttl_s", "6148914691236517206", "store.ttl_s"), // * 1000 wraps
        ("[agent]", "queue", "65536", "agent config"),
        ("[agent]", "server_id", "-1", "agent config"),
        ("[store]", "ttl_s", "-5", "agent config"),
    ] {
        let text = GOOD.replace(section, &format!("{section}\n{field} = {value}"));
        let e = Agent::from_toml(&text).err().unwrap_or_else(|| panic!("{field} = {value} accepted"));
        assert!(e.contains(want), "{field} = {value}: {e}");
    }
}
