//! Every descriptor the control floor opens is close-on-exec (issue 9, item 11): the agent
//! runs `ss`, the guard `iptables` and `ip`; none of them may inherit a store connection or a
//! wake-up eventfd.

use std::time::Duration;
use unbroken_control::object::kv::{KvStore, RedisKv};
use unbroken_control::object::store::StoreConfig;

#[path = "../../drivers/tests/common/fdcheck.rs"]
mod fdcheck;
use fdcheck::{assert_not_inherited, new_kernel_fds, open_fds};

#[test]
fn hostile_store_fds_are_not_inherited() {
    let before = open_fds();
    // A store nobody answers (port 1 on loopback): the client starts, keeps trying, and its
    // descriptors exist meanwhile.
    let cfg = StoreConfig { nodes: vec!["127.0.0.1:1".into()], timeout: Duration::from_millis(20), ..StoreConfig::default() };
    let kv = RedisKv::start(&cfg).expect("start");
    let wake = kv.wake_fd().expect("wake fd");
    let _ = kv.get(b"k"); // a blocking client too (fails: nobody listens)
    let new = new_kernel_fds(&before);
    assert!(new.iter().any(|(n, _)| *n == wake), "{new:?}");
    assert_not_inherited(&new);
}
