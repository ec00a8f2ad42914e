//! The object-mode lab (TRODS, seed 000, section 2.1): unmodified servers that share one
//! service address (the VIP) behind a stateless layer-2 load balancer ([`unbroken_control::object::lb`]).
//!
//! ```text
//!  client ─────────── lb ──────────────── bridge lbr ─┬─ s1 ── srv1 eth0 10.78.0.11  (VIP on lo)
//!  c0 10.77.0.2       l0 10.77.0.1        10.78.0.1   ├─ s2 ── srv2 eth0 10.78.0.12  (VIP on lo)
//!  fd77::2            fd77::1             fd78::1     ├─ ...
//!                     (ingress hook: the balancer)    └─ store ── store eth0 10.78.0.2 (redis)
//! ```
//!
//! * The balancer's nft table sits on `l0`'s ingress hook and forwards VIP traffic to `lbr`
//!   with the owning server's MAC ([`server_mac`]). Server replies are routed normally
//!   (server -> lb -> client); the balancer only sees the client's direction.
//! * The client's /24 contains the VIP (10.77.0.100, fd77::100), so the client asks for it by
//!   ARP / neighbour solicitation on its link. The lb namespace answers with proxy entries on
//!   `l0` (`proxy_delay` 0, `proxy_ndp` on) and routes the VIP to `lbr`; the route makes the
//!   proxy reply legal (Linux refuses to proxy an address routed back out of the asking port)
//!   and sends unbalanced VIP traffic (other ports, ICMP) toward the servers, which never answer
//!   ARP or ND for it on `eth0` (`arp_ignore` 1, `arp_announce` 2; IPv6 only answers for
//!   addresses of the asking interface), so it is dropped there.
//! * Every MAC is fixed (including the bridge's, so neighbour caches never go stale).
//!
//! [`ObjectLab::crash_server`] is power loss ([`Lab::crash_host`]): the server's `eth0` goes
//! down, then its processes are SIGKILLed; its sockets stay frozen until
//! [`ObjectLab::revive_server`].

use crate::lab::{self, Lab};
use unbroken_control::object::lb::LbConfig;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long nginx and redis may take to accept connections.
const READY_DEADLINE: Duration = Duration::from_secs(10);

/// Addresses of the object lab.
/// The heartbeat key of the lab's balancer and agents (hex, 32 bytes; a lab value, never a
/// production one).
pub const KEY_HEX: &str = "6c616220686561727462656174206b657920666f7220756e62726f6b656e2121";

pub mod addr {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};

    /// The client (dev `c0`).
    pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
    /// The client (dev `c0`).
    pub const CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 2);
    /// The balancer toward the client (dev `l0`), the client's default gateway.
    pub const LB_CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
    /// The balancer toward the client (dev `l0`), the client's default gateway.
    pub const LB_CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 1);
    /// The balancer on the server bridge (`lbr`), the servers' default gateway.
    pub const LB_V4: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 1);
    /// The balancer on the server bridge (`lbr`), the servers' default gateway.
    pub const LB_V6: Ipv6Addr = Ipv6Addr::new(0xfd78, 0, 0, 0, 0, 0, 0, 1);
    /// The key-value store host.
    pub const STORE_V4: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 2);
    /// The key-value store host.
    pub const STORE_V6: Ipv6Addr = Ipv6Addr::new(0xfd78, 0, 0, 0, 0, 0, 0, 2);
    /// The service address every server holds on `lo`.
    pub const VIP_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 100);
    /// The service address every server holds on `lo`.
    pub const VIP_V6: Ipv6Addr = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 0x100);
    /// The balanced HTTP port.
    pub const HTTP_PORT: u16 = 80;
    /// The port the liveness monitor listens on (on [`LB_V4`]).
    pub const HEARTBEAT_PORT: u16 = 7950;
    /// Where agents send heartbeats.
    pub const HEARTBEAT: SocketAddr = SocketAddr::V4(SocketAddrV4::new(LB_V4, HEARTBEAT_PORT));
    /// The conventional redis port.
    pub const REDIS_PORT: u16 = 6379;

    /// Server `i`'s own address (1-based): 10.78.0.11, 10.78.0.12, ...
    pub const fn server_v4(i: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 78, 0, 10 + i)
    }
    /// Server `i`'s own address (1-based): fd78::11, fd78::12, ... (hex digits, as written)
    pub const fn server_v6(i: u8) -> Ipv6Addr {
        Ipv6Addr::new(0xfd78, 0, 0, 0, 0, 0, 0, 0x10 + i as u16)
    }
}

/// Interface names of the object lab.
pub mod dev {
    /// The client's interface.
    pub const CLIENT: &str = "c0";
    /// The balancer's client-facing interface (the ingress hook).
    pub const LB_CLIENT: &str = "l0";
    /// The bridge in the lb namespace that the servers and the store hang off.
    pub const BRIDGE: &str = "lbr";
    /// The bridge port toward the store.
    pub const STORE_PORT: &str = "store";
    /// A server's (and the store's) interface.
    pub const HOST: &str = "eth0";
    /// The bridge port toward server `i`: `s1`, `s2`, ...
    pub fn server_port(i: usize) -> String {
        format!("s{i}")
    }
}

/// MAC of server `i`'s `eth0` (1-based): `02:75:62:01:00:0i`.
pub const fn server_mac(i: usize) -> [u8; 6] {
    [0x02, 0x75, 0x62, 0x01, 0x00, i as u8]
}

const CLIENT_MAC: [u8; 6] = [0x02, 0x75, 0x62, 0x10, 0x00, 0x02];
const LB_CLIENT_MAC: [u8; 6] = [0x02, 0x75, 0x62, 0x10, 0x00, 0x01];
const BRIDGE_MAC: [u8; 6] = [0x02, 0x75, 0x62, 0x11, 0x00, 0x01];
const STORE_MAC: [u8; 6] = [0x02, 0x75, 0x62, 0x03, 0x00, 0x02];
const STORE_PORT_MAC: [u8; 6] = [0x02, 0x75, 0x62, 0x02, 0x01, 0x00];
const fn port_mac(i: usize) -> [u8; 6] {
    [0x02, 0x75, 0x62, 0x02, 0x00, i as u8]
}

/// Options of [`ObjectLab::build`].
#[derive(Debug, Clone)]
pub struct ObjectOpts {
    /// Number of servers, 1 to 32 (default 3).
    pub servers: usize,
    /// Count RSTs arriving at the client ([`lab::install_rst_counter`]; default true).
    pub rst_counter: bool,
}

impl Default for ObjectOpts {
    fn default() -> Self {
        ObjectOpts {
            servers: 3,
            rst_counter: true,
        }
    }
}

/// The object-mode lab. Dereferences to its [`Lab`]; dropping it removes everything.
#[derive(Debug)]
pub struct ObjectLab {
    /// The namespaces.
    pub lab: Lab,
    /// Namespace of the unmodified client.
    pub client: String,
    /// Namespace of the balancer (and the bridge).
    pub lb: String,
    /// Namespace of the key-value store.
    pub store: String,
    /// Server namespaces; index 0 is server 1.
    pub servers: Vec<String>,
}

impl std::ops::Deref for ObjectLab {
    type Target = Lab;
    fn deref(&self) -> &Lab {
        &self.lab
    }
}

impl std::ops::DerefMut for ObjectLab {
    fn deref_mut(&mut self) -> &mut Lab {
        &mut self.lab
    }
}

fn ip_ok(ns: &str, args: &[&str]) -> io::Result<()> {
    lab::run_ok(ns, Command::new("ip").args(args)).map(|_| ())
}

impl ObjectLab {
    /// Builds the topology of the module docs.
    pub fn build(opts: ObjectOpts) -> io::Result<ObjectLab> {
        let n = opts.servers;
        if !(1..=32).contains(&n) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "1 to 32 servers",
            ));
        }
        // Whatever fails below, dropping `lab` removes what was built.
        let mut lab = Lab::new();
        let client = lab.add_ns("client")?;
        let lb = lab.add_ns("lb")?;
        let store = lab.add_ns("store")?;
        let mut servers = Vec::new();
        for i in 1..=n {
            servers.push(lab.add_ns(&format!("srv{i}"))?);
        }

        // The balancer routes and does no reverse-path filtering (set before its links exist,
        // so they inherit the defaults).
        lab::sysctls(
            &lb,
            &[
                ("net.ipv4.ip_forward", "1"),
                ("net.ipv6.conf.all.forwarding", "1"),
                ("net.ipv6.conf.default.forwarding", "1"),
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
            ],
        )?;

        // client <-> lb
        lab.add_veth(
            &client,
            dev::CLIENT,
            Some(CLIENT_MAC),
            &lb,
            dev::LB_CLIENT,
            Some(LB_CLIENT_MAC),
        )?;
        lab.add_addr(&client, dev::CLIENT, &format!("{}/24", addr::CLIENT_V4))?;
        lab.add_addr(&client, dev::CLIENT, &format!("{}/64", addr::CLIENT_V6))?;
        lab.add_route(&client, &format!("default via {}", addr::LB_CLIENT_V4))?;
        lab.add_route(&client, &format!("default via {}", addr::LB_CLIENT_V6))?;
        lab.add_addr(&lb, dev::LB_CLIENT, &format!("{}/24", addr::LB_CLIENT_V4))?;
        lab.add_addr(&lb, dev::LB_CLIENT, &format!("{}/64", addr::LB_CLIENT_V6))?;

        // the server bridge
        lab.add_bridge(&lb, dev::BRIDGE, false)?;
        let bm = lab::mac_string(BRIDGE_MAC);
        ip_ok(&lb, &["link", "set", dev::BRIDGE, "address", &bm])?;
        lab.add_addr(&lb, dev::BRIDGE, &format!("{}/24", addr::LB_V4))?;
        lab.add_addr(&lb, dev::BRIDGE, &format!("{}/64", addr::LB_V6))?;

        // store
        lab.add_veth(
            &store,
            dev::HOST,
            Some(STORE_MAC),
            &lb,
            dev::STORE_PORT,
            Some(STORE_PORT_MAC),
        )?;
        lab.attach(&lb, dev::STORE_PORT, dev::BRIDGE)?;
        lab.add_addr(&store, dev::HOST, &format!("{}/24", addr::STORE_V4))?;
        lab.add_addr(&store, dev::HOST, &format!("{}/64", addr::STORE_V6))?;
        lab.add_route(&store, &format!("default via {}", addr::LB_V4))?;
        lab.add_route(&store, &format!("default via {}", addr::LB_V6))?;

        // servers
        for (k, srv) in servers.iter().enumerate() {
            let i = k + 1;
            let port = dev::server_port(i);
            lab.add_veth(
                srv,
                dev::HOST,
                Some(server_mac(i)),
                &lb,
                &port,
                Some(port_mac(i)),
            )?;
            lab.attach(&lb, &port, dev::BRIDGE)?;
            lab.add_addr(srv, dev::HOST, &format!("{}/24", addr::server_v4(i as u8)))?;
            lab.add_addr(srv, dev::HOST, &format!("{}/64", addr::server_v6(i as u8)))?;
            lab.add_addr(srv, "lo", &format!("{}/32", addr::VIP_V4))?;
            lab.add_addr(srv, "lo", &format!("{}/128", addr::VIP_V6))?;
            lab.add_route(srv, &format!("default via {}", addr::LB_V4))?;
            lab.add_route(srv, &format!("default via {}", addr::LB_V6))?;
            lab::sysctls(
                srv,
                &[
                    ("net.ipv4.conf.all.arp_ignore", "1"),
                    ("net.ipv4.conf.all.arp_announce", "2"),
                    ("net.ipv4.conf.eth0.arp_ignore", "1"),
                    ("net.ipv4.conf.eth0.arp_announce", "2"),
                ],
            )?;
        }

        // The balancer answers ARP / ND for the VIP on the client side.
        lab.add_route(&lb, &format!("{}/32 dev {}", addr::VIP_V4, dev::BRIDGE))?;
        lab.add_route(&lb, &format!("{}/128 dev {}", addr::VIP_V6, dev::BRIDGE))?;
        let l0 = dev::LB_CLIENT;
        let kv = [
            (format!("net.ipv4.conf.{l0}.rp_filter"), "0"),
            (format!("net.ipv4.conf.{}.rp_filter", dev::BRIDGE), "0"),
            (format!("net.ipv4.neigh.{l0}.proxy_delay"), "0"),
            (format!("net.ipv6.neigh.{l0}.proxy_delay"), "0"),
            (format!("net.ipv6.conf.{l0}.proxy_ndp"), "1"),
        ];
        let kv: Vec<(&str, &str)> = kv.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        lab::sysctls(&lb, &kv)?;
        let (v4, v6) = (addr::VIP_V4.to_string(), addr::VIP_V6.to_string());
        ip_ok(&lb, &["-4", "neigh", "add", "proxy", &v4, "dev", l0])?;
        ip_ok(&lb, &["-6", "neigh", "add", "proxy", &v6, "dev", l0])?;

        if opts.rst_counter {
            lab::install_rst_counter(&client)?;
        }
        Ok(ObjectLab {
            lab,
            client,
            lb,
            store,
            servers,
        })
    }

    /// Namespace of the client.
    pub fn client(&self) -> &str {
        &self.client
    }

    /// Namespace of the balancer.
    pub fn lb(&self) -> &str {
        &self.lb
    }

    /// Namespace of the store.
    pub fn store(&self) -> &str {
        &self.store
    }

    /// Namespace of server `i` (1-based). Panics when there is no such server.
    pub fn server(&self, i: usize) -> &str {
        &self.servers[i - 1]
    }

    /// MAC of server `i`'s `eth0` (1-based).
    pub fn server_mac(&self, i: usize) -> [u8; 6] {
        server_mac(i)
    }

    /// Number of servers.
    pub fn n_servers(&self) -> usize {
        self.servers.len()
    }

    /// A balancer config for this lab: `l0` -> `lbr`, the VIP's port 80 (both families),
    /// heartbeats on [`addr::HEARTBEAT`], server ids 1..=n, the key [`KEY_HEX`], other defaults.
    pub fn lb_config(&self) -> LbConfig {
        let servers: Vec<(u16, [u8; 6])> = (1..=self.servers.len())
            .map(|i| (i as u16, server_mac(i)))
            .collect();
        let mut c = LbConfig::new(
            dev::LB_CLIENT,
            dev::BRIDGE,
            &[
                SocketAddr::new(IpAddr::V4(addr::VIP_V4), addr::HTTP_PORT),
                SocketAddr::new(IpAddr::V6(addr::VIP_V6), addr::HTTP_PORT),
            ],
            addr::HEARTBEAT,
            &servers,
        );
        c.key = KEY_HEX.to_string();
        c
    }

    /// Power loss of server `i` ([`Lab::crash_host`]).
    pub fn crash_server(&mut self, i: usize) -> io::Result<()> {
        let ns = self.server(i).to_string();
        self.lab.crash_host(&ns)
    }

    /// Reboot server `i` after [`crash_server`](Self::crash_server) ([`Lab::revive_host`]:
    /// sockets destroyed, links, addresses including the VIP, and routes restored). Processes
    /// (nginx, agent) must be started again.
    pub fn revive_server(&mut self, i: usize) -> io::Result<()> {
        let ns = self.server(i).to_string();
        self.lab.revive_host(&ns)
    }

    /// Start nginx on server `i` serving `docroot`, with its config, pid, logs and temp files
    /// in `run_dir` (created); returns once it accepts connections on 127.0.0.1:80 and
    /// [::1]:80. See [`nginx_conf`].
    pub fn start_nginx(&self, i: usize, docroot: &Path, run_dir: &Path) -> io::Result<Child> {
        let ns = self.server(i).to_string();
        std::fs::create_dir_all(run_dir)?;
        let conf = run_dir.join("nginx.conf");
        std::fs::write(&conf, nginx_conf(docroot, run_dir))?;
        let bin = if Path::new("/usr/sbin/nginx").exists() {
            PathBuf::from("/usr/sbin/nginx")
        } else {
            PathBuf::from("nginx")
        };
        let mut child = lab::spawn(
            &ns,
            Command::new(bin)
                .arg("-p")
                .arg(run_dir)
                .arg("-e")
                .arg(run_dir.join("error.log"))
                .arg("-c")
                .arg(&conf)
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        )
        .map_err(|e| io::Error::new(e.kind(), format!("starting nginx in {ns}: {e}")))?;
        let targets = [
            SocketAddr::from(([127, 0, 0, 1], addr::HTTP_PORT)),
            SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST), addr::HTTP_PORT),
        ];
        let log = run_dir.join("error.log");
        match wait_ready(&ns, &mut child, &targets, None, &log) {
            Ok(()) => Ok(child),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(io::Error::new(e.kind(), format!("nginx in {ns}: {e}")))
            }
        }
    }

    /// Start `redis-server` in the store namespace on [`addr::STORE_V4`] and `::` port `port`
    /// (`--save '' --appendonly no --protected-mode no`, logs to stdout, which is discarded);
    /// returns once it answers PING.
    pub fn start_redis(&self, port: u16) -> io::Result<Child> {
        let ns = self.store.clone();
        let mut child = lab::spawn(
            &ns,
            Command::new("redis-server")
                .args(["--port", &port.to_string()])
                .args(["--bind", &addr::STORE_V4.to_string(), "::"])
                .args(["--save", ""])
                .args(["--appendonly", "no"])
                .args(["--protected-mode", "no"])
                .args(["--daemonize", "no"])
                .arg("--dir")
                .arg(std::env::temp_dir())
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        )
        .map_err(|e| io::Error::new(e.kind(), format!("starting redis-server in {ns}: {e}")))?;
        let targets = [
            SocketAddr::new(IpAddr::V4(addr::STORE_V4), port),
            SocketAddr::new(IpAddr::V6(addr::STORE_V6), port),
        ];
        match wait_ready(
            &ns,
            &mut child,
            &targets,
            Some((b"PING\r\n", b"+PONG")),
            Path::new(""),
        ) {
            Ok(()) => Ok(child),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(io::Error::new(e.kind(), format!("redis in {ns}: {e}")))
            }
        }
    }
}

/// Poll (bounded) until every target accepts a connection (and, with `probe`, answers the
/// request with a reply starting with the expected bytes), or the child exits.
fn wait_ready(
    ns: &str,
    child: &mut Child,
    targets: &[SocketAddr],
    probe: Option<(&[u8], &[u8])>,
    log: &Path,
) -> io::Result<()> {
    let deadline = Instant::now() + READY_DEADLINE;
    lab::in_ns(ns, || -> io::Result<()> {
        let try_one = |t: &SocketAddr| -> io::Result<()> {
            let mut s = TcpStream::connect_timeout(t, Duration::from_millis(200))?;
            if let Some((req, want)) = probe {
                s.set_read_timeout(Some(Duration::from_millis(500)))?;
                s.write_all(req)?;
                let mut buf = vec![0u8; want.len()];
                s.read_exact(&mut buf)?;
                if buf != want {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unexpected answer {:?}", String::from_utf8_lossy(&buf)),
                    ));
                }
            }
            Ok(())
        };
        let mut pending: Vec<SocketAddr> = targets.to_vec();
        loop {
            pending.retain(|t| try_one(t).is_err());
            if pending.is_empty() {
                return Ok(());
            }
            if let Some(st) = child.try_wait()? {
                let tail = std::fs::read_to_string(log).unwrap_or_default();
                let tail: String = tail.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                return Err(io::Error::other(format!("exited early ({st}): {tail}")));
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{pending:?} not accepting after {READY_DEADLINE:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    })?
}

fn quoted(p: &Path) -> String {
    let s = p.display().to_string();
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The nginx 1.22 configuration of a lab server: `daemon off` and `master_process off` (one
/// process: the returned [`Child`] is the whole server, and killing it leaves no orphaned
/// worker), `worker_processes 1` with 16384 connections, pid and error log in `run_dir`, `access_log off`,
/// `sendfile on`, `etag on` (off under `/noetag/`), `keepalive_timeout 65`, listening on
/// `0.0.0.0:80` and `[::]:80`, every temp path inside `run_dir`, serving `docroot`.
pub fn nginx_conf(docroot: &Path, run_dir: &Path) -> String {
    let r = |s: &str| quoted(&run_dir.join(s));
    format!(
        "daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 65536;
pid {pid};
error_log {err} info;

events {{
    # Room for the mass-failover test: 10,000 downloads over three servers, the survivors'
    # share after a death, and the agents' resume requests.
    worker_connections 16384;
}}

http {{
    access_log off;
    sendfile on;
    etag on;
    keepalive_timeout 65;
    default_type application/octet-stream;
    types {{
        text/html html htm;
        text/plain txt;
    }}
    client_body_temp_path {cb};
    proxy_temp_path {px};
    fastcgi_temp_path {fc};
    uwsgi_temp_path {uw};
    scgi_temp_path {sc};

    server {{
        listen 0.0.0.0:80;
        listen [::]:80;
        server_name _;
        root {root};
        # Objects served without an ETag (Last-Modified only): issue 9 item 8's lab test.
        location /noetag/ {{
            etag off;
        }}
    }}
}}
",
        pid = r("nginx.pid"),
        err = r("error.log"),
        cb = r("client_body"),
        px = r("proxy"),
        fc = r("fastcgi"),
        uw = r("uwsgi"),
        sc = r("scgi"),
        root = quoted(docroot),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nginx_conf_has_what_the_brief_asks() {
        let c = nginx_conf(Path::new("/srv/www"), Path::new("/tmp/run 1"));
        for want in [
            "daemon off;",
            "master_process off;",
            "worker_processes 1;",
            "pid \"/tmp/run 1/nginx.pid\";",
            "error_log \"/tmp/run 1/error.log\" info;",
            "access_log off;",
            "sendfile on;",
            "etag on;",
            "keepalive_timeout 65;",
            "listen 0.0.0.0:80;",
            "listen [::]:80;",
            "root \"/srv/www\";",
            "location /noetag/ {\n            etag off;",
            "client_body_temp_path \"/tmp/run 1/client_body\";",
        ] {
            assert!(c.contains(want), "{want} missing in\n{c}");
        }
        assert_eq!(server_mac(3), [2, 0x75, 0x62, 1, 0, 3]);
        assert_eq!(addr::server_v4(2).to_string(), "10.78.0.12");
        assert_eq!(addr::server_v6(2).to_string(), "fd78::12");
    }
}
