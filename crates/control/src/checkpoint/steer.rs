//! The steering rules of a guard: its services' TCP traffic into its NFQUEUE, injected packets
//! (carrying the guard's mark) exempt.

use crate::checkpoint::config::Guard as Config;
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
    s.app_iface = g.app_interface.clone();
    s
}

/// Checks a gateway guard's `app_interface` against the system: it must exist, and every
/// service address must be routed through it (else the service's packets would never be
/// queued, or the wrong side's would be). Run inside the guard's network namespace.
pub fn check_app_interface(cfg: &Config) -> Result<(), String> {
    let Some(ifname) = &cfg.raw.guard.app_interface else { return Ok(()) };
    let c = std::ffi::CString::new(ifname.as_str()).map_err(|_| format!("guard.app_interface {ifname:?}: not a name"))?;
    // SAFETY: a valid NUL-terminated string.
    if unsafe { libc::if_nametoindex(c.as_ptr()) } == 0 {
        return Err(format!("guard.app_interface {ifname:?}: no such interface here ({})", std::io::Error::last_os_error()));
    }
    for svc in &cfg.raw.services {
        if svc.addr.is_unspecified() {
            continue;
        }
        let out = match std::process::Command::new("ip").arg("-o").arg("route").arg("get").arg(svc.addr.to_string()).env("LC_ALL", "C").output() {
            Ok(o) if o.status.success() => o,
            // No `ip` or no route yet: the rules still hold; say so rather than refuse.
            Ok(o) => {
                eprintln!("guard: cannot check the route to service {}: {}", svc.addr, String::from_utf8_lossy(&o.stderr).trim());
                continue;
            }
            Err(e) => {
                eprintln!("guard: cannot check the route to service {} (`ip route get`): {e}", svc.addr);
                continue;
            }
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let dev = text.split_whitespace().skip_while(|w| *w != "dev").nth(1);
        if let Some(dev) = dev {
            if dev != ifname {
                return Err(format!("guard.app_interface {ifname:?}: service {} is routed through {dev:?}, not through it: name the interface toward the application hosts", svc.addr));
            }
        }
    }
    Ok(())
}
