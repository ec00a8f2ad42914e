//! Every descriptor the control floor opens is close-on-exec (issue 9, item 11): the agent
//! runs `ss`, the guard `iptables` and `ip`; none of them may inherit a store connection or a
//! wake-up eventfd.

use std::collections::BTreeMap;
use std::time::Duration;
use unbroken_control::kv::{KvStore, RedisKv};
use unbroken_control::store::StoreConfig;

/// Sockets, eventfds and the like: what a daemon's own code opens (other tests running at the
/// same time open files and pipes, and a child's stdin is `/dev/null` too).
fn is_kernel_object(target: &str) -> bool {
    target.starts_with("socket:") || target.starts_with("anon_inode:")
}

fn open_fds() -> BTreeMap<i32, String> {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| {
            let e = e.ok()?;
            let n: i32 = e.file_name().to_str()?.parse().ok()?;
            Some((n, std::fs::read_link(e.path()).ok()?.to_string_lossy().into_owned()))
        })
        .collect()
}

#[test]
fn hostile_store_fds_are_not_inherited() {
    let before = open_fds();
    // A store nobody answers (port 1 on loopback): the client starts, keeps trying, and its
    // descriptors exist meanwhile.
    let cfg = StoreConfig { nodes: vec!["127.0.0.1:1".into()], timeout: Duration::from_millis(20), ..StoreConfig::default() };
    let kv = RedisKv::start(&cfg).expect("start");
    let wake = kv.wake_fd().expect("wake fd");
    let _ = kv.get(b"k"); // a blocking client too (fails: nobody listens)
    let new: Vec<(i32, String)> = open_fds().into_iter().filter(|(n, t)| before.get(n) != Some(t)).filter(|(_, t)| is_kernel_object(t)).collect();
    assert!(new.iter().any(|(n, _)| *n == wake), "{new:?}");
    for (n, target) in &new {
        // SAFETY: F_GETFD on a descriptor number; one closed meanwhile just fails.
        let flags = unsafe { libc::fcntl(*n, libc::F_GETFD) };
        assert!(flags < 0 || flags & libc::FD_CLOEXEC != 0, "fd {n} ({target}) is not close-on-exec");
    }
    let child = std::process::Command::new("ls").arg("-l").arg("/proc/self/fd/").output().expect("ls");
    let listing = String::from_utf8_lossy(&child.stdout);
    for (n, target) in &new {
        assert!(!listing.contains(target.as_str()), "a child inherited fd {n} ({target}):\n{listing}");
    }
}
