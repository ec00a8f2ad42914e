include!("common/require.rs");
use unbroken_drivers::fastpath::replica::Replica;
#[test]
fn loads() {
    match Replica::load() { Ok(_) => {}, Err(e) => panic!("{e}") }
}
