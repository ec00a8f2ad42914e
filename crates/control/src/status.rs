//! Status files the daemons write (`unbroken status --file` reads them).
//!
//! Every such file is replaced through a temporary file beside it ([`write_atomic`]), which
//! this process creates new (`O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0644, a random name): the
//! daemons run as root in directories other users may write to, and a temporary name anyone
//! can predict and we would open through a symlink lets a local user have root overwrite any
//! file (issue 20 item 14).

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Replaces the content of `path` with `bytes` atomically: written to a new temporary file
/// beside it ([`create_temp_beside`]), then renamed over it (a reader never sees half a
/// document; a symlink at `path` itself is replaced, not followed). The temporary file is
/// removed when anything fails.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let (tmp, mut f) = create_temp_beside(path)?;
    let r = f.write_all(bytes).and_then(|_| std::fs::rename(&tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Tries for a fresh temporary name before giving up (each a 64-bit random name: a clash is
/// someone planting files, not chance).
const TEMP_TRIES: usize = 8;

/// A file this process has just created beside `path`, `<path>.tmp<pid>.<16 random hex
/// digits>`, with `O_CREAT|O_EXCL|O_NOFOLLOW` (whatever already has that name, a symlink
/// above all, is never opened) and mode 0644 (less the umask).
pub fn create_temp_beside(path: &Path) -> io::Result<(PathBuf, File)> {
    for _ in 0..TEMP_TRIES {
        let mut name: OsString = path.as_os_str().to_owned();
        name.push(format!(".tmp{}.{:016x}", std::process::id(), random_u64()?));
        let name = PathBuf::from(name);
        match create_new(&name) {
            Ok(f) => return Ok((name, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("{TEMP_TRIES} fresh temporary names beside {} were all taken", path.display()),
    ))
}

/// Creates `name`, which must not exist (not even as a dangling symlink), for writing.
fn create_new(name: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(name)
}

/// Eight bytes from the kernel's CSPRNG (getrandom(2)).
fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: writes at most `len - got` bytes into our buffer.
        let r = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += r as usize;
    }
    Ok(u64::from_ne_bytes(b))
}

/// Makes sure a status file can be written at `path` before the daemon says `ready`: creates
/// its directory when missing and writes (then removes) a probe file beside it, created as
/// [`create_temp_beside`] does. `what` names
/// the setting in the error (`agent: status_file`, `--status-file`), so a wrong path is one
/// clear error at start, not a line every time the status is written.
pub fn prepare(path: &Path, what: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{what} {}: cannot create its directory {}: {e}", path.display(), dir.display()))?;
    }
    create_temp_beside(path)
        .and_then(|(probe, mut f)| {
            let r = f.write_all(b"{}");
            std::fs::remove_file(&probe).and(r)
        })
        .map_err(|e| format!("{what} {}: cannot write there: {e}", path.display()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A scratch directory of this test process, removed when dropped.
    pub(crate) struct Scratch(pub std::path::PathBuf);

    impl Scratch {
        pub(crate) fn new(name: &str) -> Scratch {
            let d = std::env::temp_dir().join(format!("ub-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Scratch(d)
        }

        /// A file another user cares about, and a symlink to it planted at `at`.
        pub(crate) fn plant(&self, at: &Path) -> std::path::PathBuf {
            let victim = self.0.join("victim");
            std::fs::write(&victim, b"precious").unwrap();
            std::os::unix::fs::symlink(&victim, at).unwrap();
            victim
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Issue 20 item 14: the probe file beside the status file was `<path>.tmp<pid>`, written
    /// through whatever a local user had planted there: a symlink made the root daemon overwrite
    /// (and here truncate to `{}`) any file. Now it is created new, never followed.
    #[test]
    fn hostile_status_probe_does_not_follow_a_planted_symlink() {
        let d = Scratch::new("status-probe");
        let path = d.0.join("s.json");
        let mut old = path.as_os_str().to_owned();
        old.push(format!(".tmp{}", std::process::id()));
        let victim = d.plant(Path::new(&old));
        prepare(&path, "test: status_file").expect("the directory is writable");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "the symlink's target is untouched");
        assert!(std::fs::symlink_metadata(&old).unwrap().file_type().is_symlink(), "not ours to remove");
        // A dangling one (the attacker's way to create a file where it likes) is not followed either.
        let target = d.0.join("created-by-us");
        std::fs::remove_file(&old).unwrap();
        std::os::unix::fs::symlink(&target, &old).unwrap();
        prepare(&path, "test: status_file").unwrap();
        assert!(!target.exists(), "nothing created through the symlink");
    }

    /// What every temporary file goes through: a name that exists in any form, a symlink to a
    /// file or a dangling one, is refused (`AlreadyExists`), never opened; `write_atomic`
    /// leaves nothing beside the file it wrote.
    #[test]
    fn hostile_temp_creation_never_opens_what_is_there() {
        let d = Scratch::new("status-create-new");
        let planted = d.0.join("planted");
        let victim = d.plant(&planted);
        assert_eq!(create_new(&planted).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let dangling = d.0.join("dangling");
        std::os::unix::fs::symlink(d.0.join("nowhere"), &dangling).unwrap();
        assert_eq!(create_new(&dangling).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert!(!d.0.join("nowhere").exists());
        let path = d.0.join("s.json");
        write_atomic(&path, b"{}").unwrap();
        write_atomic(&path, b"{\"b\":2}").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"b\":2}");
        let mut names: Vec<_> = std::fs::read_dir(&d.0).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["dangling", "planted", "s.json", "victim"], "no temporary file left");
    }
}
