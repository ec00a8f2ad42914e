//! Compiles the fast path's BPF programs (`bpf/<mode>/*.c`, shared headers in `bpf/common/`)
//! with clang into `$OUT_DIR/<name>.o`, which `src/fastpath` embeds. A missing clang (or
//! missing headers) fails the build with the line that installs them.

use std::path::{Path, PathBuf};
use std::process::Command;

const INSTALL: &str = "apt-get install -y --no-install-recommends clang libbpf-dev linux-libc-dev";

/// The programs: (source under bpf/, object name, extra clang flags). Object mode's programs
/// use atomic `or` on map values (BPF ISA v3; every kernel this project targets has it).
const PROGRAMS: &[(&str, &str, &[&str])] = &[
    ("checkpoint/ckpt_tc.c", "ckpt_tc.o", &[]),
    ("object/obj_fast.c", "obj_fast.o", &["-mcpu=v3"]),
    ("replica/rep_tc.c", "rep_tc.o", &[]),
];

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("bpf");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=build.rs");
    rerun_for(&dir);
    // Debian's multiarch include directory, where asm/types.h lives (without it clang -target
    // bpf does not find it).
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap();
    let multiarch = format!("/usr/include/{arch}-linux-gnu");
    if !Path::new(&multiarch).join("asm/types.h").exists() {
        panic!("BPF fast path: {multiarch}/asm/types.h is missing (package linux-libc-dev). Install what the build needs with:\n  {INSTALL}");
    }
    for (src, obj, extra) in PROGRAMS {
        let status = Command::new("clang")
            .args(["-O2", "-g", "-target", "bpf", "-Wall"])
            .args(*extra)
            .arg(format!("-I{multiarch}"))
            .arg("-c")
            .arg(dir.join(src))
            .arg("-o")
            .arg(out.join(obj))
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("BPF fast path: clang failed on bpf/{src} ({s}); if a header was not found (bpf/bpf_helpers.h is libbpf-dev's, linux/*.h linux-libc-dev's), install what the build needs with:\n  {INSTALL}"),
            Err(e) => panic!("BPF fast path: cannot run clang ({e}). Install what the build needs with:\n  {INSTALL}"),
        }
    }
}

fn rerun_for(dir: &Path) {
    for e in std::fs::read_dir(dir).expect("crates/drivers/bpf").flatten() {
        let p = e.path();
        if p.is_dir() {
            rerun_for(&p);
        } else {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
}
