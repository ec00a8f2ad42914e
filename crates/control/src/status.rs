//! Status files the daemons write (`unbroken status --file` reads them).

use std::path::Path;

/// Makes sure a status file can be written at `path` before the daemon says `ready`: creates
/// its directory when missing and writes (then removes) a probe file beside it. `what` names
/// the setting in the error (`agent: status_file`, `--status-file`), so a wrong path is one
/// clear error at start, not a line every time the status is written.
pub fn prepare(path: &Path, what: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{what} {}: cannot create its directory {}: {e}", path.display(), dir.display()))?;
    }
    let mut probe = path.as_os_str().to_owned();
    probe.push(format!(".tmp{}", std::process::id()));
    std::fs::write(&probe, b"{}")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| format!("{what} {}: cannot write there: {e}", path.display()))
}
