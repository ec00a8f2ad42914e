//! The C ABI from C: compiles tests/c/abi_test.c against include/unbroken.h (strict C99) and
//! the cdylib cargo built for this test run, runs it against the in-test guard, then checks
//! what the guard saw. Skipped (with a message) when gcc is missing; with UNBROKEN_REQUIRE_LAB=1
//! that is a failure instead (`common::skip_or_fail`).

mod common;

use common::{skip_or_fail, TestGuard, KEY_HEX, WRONG_KEY_HEX};
use std::path::{Path, PathBuf};
use std::process::Command;
use unbroken_sdk::ConnRecord;
use unbroken_wire::ctl::flag;

fn gcc() -> Option<&'static str> {
    ["gcc", "cc"].into_iter().find(|cc| Command::new(cc).arg("--version").output().map(|o| o.status.success()).unwrap_or(false))
}

/// This test runs from target/<profile>/deps/, where cargo writes the cdylib it builds for
/// the test run (the copy in target/<profile>/ is only refreshed by `cargo build`).
fn cdylib() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    [deps.join("libunbroken_sdk.so"), deps.parent()?.join("libunbroken_sdk.so")].into_iter().find(|p| p.exists())
}

fn out_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("unbroken-sdk-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn c_program_against_the_cdylib() {
    let Some(cc) = gcc() else {
        skip_or_fail("c_program_against_the_cdylib", "no gcc/cc on PATH");
        return;
    };
    let lib = cdylib().expect("libunbroken_sdk.so not found next to the test binary (crate-type cdylib)");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = out_dir("c-abi");
    let exe = out.join("abi_test");
    let libdir = lib.parent().unwrap();
    let status = Command::new(cc)
        .args(["-std=c99", "-D_POSIX_C_SOURCE=200809L", "-pedantic", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(manifest.join("tests/c/abi_test.c"))
        .arg("-I")
        .arg(manifest.join("include"))
        .arg("-L")
        .arg(libdir)
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-lunbroken_sdk")
        .status()
        .unwrap();
    assert!(status.success(), "compiling abi_test.c failed");

    let g = TestGuard::start();
    let (app, peer) = ("127.0.0.1:7000".parse().unwrap(), "127.0.0.1:41000".parse().unwrap());
    g.handshake(app, peer, 0x1000, 0xffff_fff0, true);
    let rec = ConnRecord::new(app, peer, 0xffff_fff1, 0x1001, None).unwrap();
    let hex: String = rec.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let run = Command::new(&exe).arg(g.addr.to_string()).arg(KEY_HEX).arg(WRONG_KEY_HEX).arg(&hex).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success() && stdout.trim() == "ok", "abi_test failed: {stdout}{}", String::from_utf8_lossy(&run.stderr));

    let conn = g.conn(app, peer).unwrap();
    assert_eq!(conn.ack_a, 0xffff_fff1u32.wrapping_add(100), "ACKNOWLEDGE(100) from C; the wrong-key 999 never applied");
    let st = g.state();
    assert!(st.unauthenticated >= 1, "the wrong-key client's tries were refused");
    assert!(st.log.iter().any(|c| c.op == unbroken_sdk::Op::ShutdownWriting));
    drop(st);
    let r = unbroken_sdk::GuardClient::from_strs(&g.addr.to_string(), KEY_HEX).unwrap().tell(app, peer).unwrap();
    assert_ne!(r.flags & flag::FIN_ALLOWED, 0);
    let _ = std::fs::remove_dir_all(&out);
}

/// The header also compiles as C++ (extern "C", no C-only constructs), if g++ is there.
#[test]
fn header_compiles_as_cpp() {
    let ok = Command::new("g++").arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
    if !ok {
        skip_or_fail("header_compiles_as_cpp", "no g++ on PATH");
        return;
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = out_dir("cpp-header");
    let out = dir.join("hdr.cpp");
    std::fs::write(&out, "#include \"unbroken.h\"\nint main() { ub_record r; (void)r; return ub_strerror(0) == 0; }\n").unwrap();
    let status = Command::new("g++")
        .args(["-std=c++11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I"])
        .arg(manifest.join("include"))
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
