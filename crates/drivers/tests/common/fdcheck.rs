//! Checks that descriptors a daemon's code opens are close-on-exec and that a child it runs
//! inherits none of them (issue 9 item 11). Shared by the drivers' and the control crate's
//! tests, which include this file with `#[path]`.

use std::collections::BTreeMap;

/// Sockets, eventfds and the like: what a daemon's own code opens (other tests running at the
/// same time open files and pipes, and a child's stdin is `/dev/null` too).
fn is_kernel_object(target: &str) -> bool {
    target.starts_with("socket:") || target.starts_with("anon_inode:")
}

/// This process's open descriptors and what they point to.
pub fn open_fds() -> BTreeMap<i32, String> {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| {
            let e = e.ok()?;
            let n: i32 = e.file_name().to_str()?.parse().ok()?;
            Some((n, std::fs::read_link(e.path()).ok()?.to_string_lossy().into_owned()))
        })
        .collect()
}

/// The kernel objects opened since `before` (see [`open_fds`]).
pub fn new_kernel_fds(before: &BTreeMap<i32, String>) -> Vec<(i32, String)> {
    open_fds().into_iter().filter(|(n, t)| before.get(n) != Some(t)).filter(|(_, t)| is_kernel_object(t)).collect()
}

/// Every descriptor of `new` is close-on-exec, and a child (`ls -l /proc/self/fd/`) holds none.
pub fn assert_not_inherited(new: &[(i32, String)]) {
    for (n, target) in new {
        // SAFETY: F_GETFD on a descriptor number; one closed meanwhile (another test's) just fails.
        let flags = unsafe { libc::fcntl(*n, libc::F_GETFD) };
        assert!(flags < 0 || flags & libc::FD_CLOEXEC != 0, "fd {n} ({target}) is not close-on-exec");
    }
    let child = std::process::Command::new("ls").arg("-l").arg("/proc/self/fd/").output().expect("ls");
    let listing = String::from_utf8_lossy(&child.stdout);
    for (n, target) in new {
        assert!(!listing.contains(target.as_str()), "a child inherited fd {n} ({target}):\n{listing}");
    }
}
