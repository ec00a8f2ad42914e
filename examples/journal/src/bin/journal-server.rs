//! journal-server: the example recoverable application (see `unbroken_journal::server`).

fn main() {
    std::process::exit(unbroken_journal::server::main_with_args(std::env::args().skip(1)));
}
