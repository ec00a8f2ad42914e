//! The backup's fast-path half (issue 22 item 4): which of the backup engine's connections the
//! kernel's programs carry (`bpf/replica/rep_tc.c`), and the hand-off of their fields between
//! the programs and [`Core`] (docs/architecture.md, "Fast path: replica mode").

use super::*;

/// The fast path's part of [`Core`].
#[derive(Default)]
pub struct FastPart {
    /// Why the fast path is off (the status's `fast_path.off_because`); `None` while on.
    pub off_because: Option<String>,
}

impl Core {
    /// The fast path is off for this reason (said once at start, shown in the status).
    pub fn fast_off(&mut self, why: String) {
        self.fast.off_because = Some(why);
    }

    /// The status's `fast_path` object.
    pub fn fast_status(&mut self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        m.insert("on".into(), false.into());
        if let Some(why) = &self.fast.off_because {
            m.insert("off_because".into(), why.clone().into());
        }
        serde_json::Value::Object(m)
    }
}
