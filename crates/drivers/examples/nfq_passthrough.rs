//! A pass-through NFQUEUE consumer for throughput measurements: installs the steering rules for
//! one TCP service on the FORWARD chain (gateway mode), accepts every packet unchanged for the
//! given number of seconds, then removes the rules and prints the counters.
//!
//! ```text
//! nfq_passthrough QUEUE SERVICE_ADDR PORT SECONDS [--no-gso] [--batch N]
//! ```
//! Run it inside the router namespace, e.g. `ip netns exec r target/release/examples/nfq_passthrough 0 10.0.2.2 5201 12`.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use unbroken_drivers::iptables::{BuiltinChain, RuleSpec, Rules, Service};
use unbroken_drivers::nfqueue::{Queue, QueueConfig, Verdict};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        return Err(
            "usage: nfq_passthrough QUEUE SERVICE_ADDR PORT SECONDS [--no-gso] [--batch N]".into(),
        );
    }
    let queue_num: u16 = args[0].parse()?;
    let addr: IpAddr = args[1].parse()?;
    let port: u16 = args[2].parse()?;
    let secs: u64 = args[3].parse()?;
    let gso = !args.iter().any(|a| a == "--no-gso");
    let batch = match args.iter().position(|a| a == "--batch") {
        Some(i) => args.get(i + 1).ok_or("--batch needs a value")?.parse()?,
        None => 64,
    };

    let mut q = Queue::open(&QueueConfig {
        queue_num,
        gso,
        ..QueueConfig::default()
    })?;
    let mut spec = RuleSpec::new(
        RuleSpec::chain_name("UNBROKEN-BENCH", queue_num.into()),
        queue_num,
        0x1,
    );
    spec.hooks = vec![BuiltinChain::Forward];
    spec.services = vec![Service::tcp(addr, port)];
    let rules = Rules::install(&spec)?;
    eprintln!(
        "queue {queue_num} bound (gso {gso}, batch {batch}); forwarding {addr}:{port} for {secs}s"
    );

    let end = Instant::now() + Duration::from_secs(secs);
    let mut pkts = Vec::new();
    let (mut bytes, mut batches, mut max_len) = (0u64, 0u64, 0usize);
    while Instant::now() < end {
        if q.recv_batch(&mut pkts, batch, Some(Duration::from_millis(100)))? == 0 {
            continue;
        }
        batches += 1;
        for p in &pkts {
            bytes += p.data.len() as u64;
            max_len = max_len.max(p.data.len());
            q.set_verdict(p.id, Verdict::Accept, None)?;
        }
        q.flush()?;
    }
    rules.remove()?;
    let s = q.stats();
    // CPU time of this process (user + system, including the kernel work done on its behalf
    // in verdict sends), a contention-robust measure of the consumer's cost.
    // SAFETY: getrusage fills a zeroed struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let (user, sys) = (tv(ru.ru_utime), tv(ru.ru_stime));
    eprintln!(
        "{s:?}\nbytes {bytes}, batches {batches} (avg {:.1} packets), largest packet {max_len}\n\
         cpu user {user:.2}s sys {sys:.2}s = {:.2} us/packet, {:.3} s/GB",
        s.received as f64 / batches.max(1) as f64,
        (user + sys) * 1e6 / s.received.max(1) as f64,
        (user + sys) * 1e9 / bytes.max(1) as f64,
    );
    q.close()?;
    Ok(())
}
