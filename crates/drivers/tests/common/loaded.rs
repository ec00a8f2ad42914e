// The fast-path tests' way to load a mode's programs, in one place: `include!`d after
// require.rs by each test that loads them. Plain `//` comments: this file is included.

/// The loaded programs, or `None` after a SKIP line (BPF unavailable here). Any other failure
/// (the verifier refusing a program, a map that cannot be made) fails the test.
pub fn loaded_or_skip<T>(test: &str, loaded: Result<T, unbroken_drivers::fastpath::Error>) -> Option<T> {
    match loaded {
        Ok(fp) => Some(fp),
        Err(unbroken_drivers::fastpath::Error::Unavailable(why)) => {
            skip_or_fail(test, &why);
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}
