//! What `/proc` says about the local server's processes (issue 20, a hung server): which
//! processes hold a socket (by its inode, as `sock_diag` names it) and how much CPU time they
//! used. Reads only; every error is "unknown", never a panic.

use std::path::Path;

/// The fields of `/proc/PID/stat` the drivers use (read after the command name, which may hold
/// spaces and parens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// Field 3: `R`, `S`, `D`, `T` (stopped), `Z`...
    pub state: char,
    /// Fields 14 and 15: user and system CPU time of every thread, in clock ticks.
    pub utime: u64,
    pub stime: u64,
    /// Field 22: the start time, in clock ticks after boot.
    pub start: u64,
}

/// Parses the text of a `/proc/PID/stat`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3.
    let at = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    Some(Stat {
        state: f.first()?.chars().next()?,
        utime: at(14)?,
        stime: at(15)?,
        start: at(22)?,
    })
}

/// `/proc/PID/stat` of `pid`, if it exists.
pub fn stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The processes that hold any of the sockets `inodes` open (a listener's inode names every
/// process of a pre-forked server: nginx's master and workers, redis alone). Walks every
/// process's descriptors: milliseconds on a busy host, for the caller to do now and then.
pub fn socket_owners(inodes: &[u32]) -> Vec<u32> {
    socket_owners_in(Path::new("/proc"), inodes)
}

fn socket_owners_in(proc: &Path, inodes: &[u32]) -> Vec<u32> {
    let names: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    let mut out = vec![];
    let Ok(dir) = std::fs::read_dir(proc) else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                if target
                    .to_str()
                    .is_some_and(|t| names.iter().any(|n| n == t))
                {
                    out.push(pid);
                    break;
                }
            }
        }
    }
    out
}

/// The CPU time (clock ticks) `pids` used together, if every one of them still exists: a
/// process gone (or replaced) makes the sum meaningless.
pub fn cpu_ticks(pids: &[u32]) -> Option<u64> {
    pids.iter()
        .map(|&p| stat(p).map(|s| s.utime + s.stime))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let t = "1234 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 111 222 13 14 15 16 17 18 99999 20";
        assert_eq!(
            parse_stat(t),
            Some(Stat {
                state: 'S',
                utime: 111,
                stime: 222,
                start: 99999
            })
        );
        assert_eq!(parse_stat("1 (x) S 1 2"), None, "truncated");
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat(""), None);
    }

    /// This process owns the socket it opened, and its CPU time grows while it computes.
    #[test]
    fn finds_the_owner_of_a_socket_and_its_cpu_time() {
        use std::os::unix::fs::MetadataExt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let inode = std::fs::metadata(format!("/proc/self/fd/{}", l.as_raw_fd()))
            .unwrap()
            .ino() as u32;
        let me = std::process::id();
        assert!(socket_owners(&[inode]).contains(&me));
        assert!(!socket_owners(&[u32::MAX]).contains(&me));
        let t0 = cpu_ticks(&[me]).unwrap();
        let mut x = 0u64;
        while cpu_ticks(&[me]).unwrap() == t0 {
            // computing until the kernel counts a tick (10 ms at USER_HZ 100)
            for i in 0..100_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            std::hint::black_box(x);
        }
        assert_eq!(cpu_ticks(&[me, u32::MAX]), None, "a process gone: unknown");
    }
}
