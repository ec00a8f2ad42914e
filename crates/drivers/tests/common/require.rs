// The skip rule of the drivers' tests, in one place: `include!`d by tests/common/mod.rs and by
// the unit tests in src/ (the drivers cannot depend on unbroken-control, whose lab.rs holds the
// same rule for the crates above). Plain `//` comments: this file is included, not a module.

/// Test `test` cannot run here because `why`: prints `SKIP test: why` for the caller to
/// return, or, with `UNBROKEN_REQUIRE_LAB=1` (`.ci/run` sets it), fails the test with the
/// reason.
pub fn skip_or_fail(test: &str, why: &str) {
    if std::env::var("UNBROKEN_REQUIRE_LAB").is_ok_and(|v| v == "1") {
        panic!("{test} cannot run and UNBROKEN_REQUIRE_LAB=1 forbids skipping it: {why}");
    }
    // Straight to stderr, past the test harness's capture: a skip shows in every run's output
    // (scripts/test.sh counts these lines).
    let line = format!("SKIP {test}: {why} (with UNBROKEN_REQUIRE_LAB=1 this fails)\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
}
