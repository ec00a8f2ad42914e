//! The steering rules of a guard: its services' TCP traffic into its NFQUEUE, injected packets
//! (carrying the guard's mark) exempt.

use crate::config::Guard as Config;
use unbroken_drivers::iptables::{BuiltinChain, RuleSpec, Rules, Service};

/// Installs the rules for `cfg` jumping from the named built-in chains, replacing those of a
/// crashed predecessor atomically (no moment without steering).
pub fn install(cfg: &Config, chains: &[&str]) -> std::io::Result<Rules> {
    Rules::install_or_replace(&spec(cfg, chains))
}

/// The rule specification for `cfg`.
pub fn spec(cfg: &Config, chains: &[&str]) -> RuleSpec {
    let g = &cfg.raw.guard;
    let mut s = RuleSpec::new(RuleSpec::chain_name("UNBROKEN-Q", g.queue as u32), g.queue, g.injection_mark);
    s.hooks = chains
        .iter()
        .filter_map(|c| match *c {
            "FORWARD" => Some(BuiltinChain::Forward),
            "INPUT" => Some(BuiltinChain::Input),
            "OUTPUT" => Some(BuiltinChain::Output),
            _ => None,
        })
        .collect();
    s.services = cfg.raw.services.iter().map(|x| Service::tcp(x.addr, x.port)).collect();
    s.queue_bypass = g.queue_bypass;
    s
}
