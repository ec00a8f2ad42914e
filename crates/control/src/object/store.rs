//! Persistent-store client for object mode (TRODS-KV).
//!
//! Object mode keeps every connection's state object in a key-value store, so that another
//! host can carry the connection on. This module is the store client: a small Redis client
//! speaking RESP2 over TCP (the codec is [`unbroken_wire::resp`]), with nothing beyond `std`
//! and `libc`.
//!
//! - [`Store`] is a blocking client (`set`, `get`, `del`, `ping`, raw `command`), for tools,
//!   setup and tests.
//! - [`StoreHandle`] is the asynchronous front end for the agent's packet loop:
//!   [`StoreHandle::submit`] never blocks, one worker thread pipelines the operations, and the
//!   loop collects [`Completion`]s with [`StoreHandle::drain`] when [`StoreHandle::wake_fd`]
//!   polls readable. Every submitted operation completes exactly once: with its result, a
//!   server error, [`StoreError::Timeout`] or [`StoreError::Down`].
//!
//! Both work against one plain Redis server or a Redis Cluster. A seed that answers
//! `CLUSTER SLOTS` with slots (or a command answered with `-MOVED`) switches to cluster
//! routing: CRC16 (XMODEM) hash slots with `{hash tags}` honoured, one connection per node,
//! `-MOVED` followed (and the slot map refreshed), `-ASK` followed with `ASKING`.
//!
//! Configuration (`[store]` in TOML; durations are an integer of milliseconds or a string with
//! a unit: `"500us"`, `"20ms"`, `"1.5s"`, `"10m"`, `"1h"`):
//!
//! ```toml
//! [store]
//! nodes = ["10.77.3.1:6379"]   # seeds, "host:port" ("[v6]:port"); one node of a cluster is enough
//! timeout = "20ms"             # per operation, submission to completion
//! connect_timeout = "100ms"    # bound on one (re)connection attempt
//! password = "secret"          # AUTH; omit for none
//! ttl = "10m"                  # SET ... PX; omit for keys that never expire
//! key_prefix = "ub:"           # prepended to every key
//! ```
#![warn(missing_docs)]

use serde::{Deserialize, Deserializer};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};
use unbroken_wire::resp::{encode_command, parse_reply, push_bulk, push_header};
/// A RESP2 reply ([`unbroken_wire::resp::Reply`]; the codec is the wire crate's).
pub use unbroken_wire::resp::Reply;

/// Number of hash slots of a Redis Cluster.
pub const SLOTS: usize = 16384;
/// Interval between reconnection attempts to a store node marked down.
pub const RECONNECT_INTERVAL: Duration = Duration::from_millis(100);
/// Capacity of a [`StoreHandle`]'s request queue (operations submitted and not yet taken by
/// the worker). A submission beyond it completes at once with [`StoreError::Down`].
pub const QUEUE_CAPACITY: usize = 16_384;
/// Redirections (`-MOVED`, `-ASK`) followed for one operation before giving up.
const MAX_REDIRECTS: u8 = 5;
/// Operations the worker takes off the queue per loop turn.
const MAX_BATCH: usize = 4096;
// ------------------------------------------------------------------------------------------
// Configuration
// ------------------------------------------------------------------------------------------

/// Configuration of the store client (`[store]` in TOML, every key optional).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Seed nodes, `"host:port"` (`"[v6]:port"` for IPv6). For a cluster one reachable node
    /// is enough; the others are learned from `CLUSTER SLOTS`. Default `["127.0.0.1:6379"]`.
    pub nodes: Vec<String>,
    /// Time allowed to one operation, from submission to completion. Default 20 ms.
    #[serde(deserialize_with = "de_duration")]
    pub timeout: Duration,
    /// Bound on one connection attempt (TCP connect, `AUTH`, `PING`). Default 100 ms.
    #[serde(deserialize_with = "de_duration")]
    pub connect_timeout: Duration,
    /// Password sent with `AUTH` on every new connection. Default none.
    pub password: Option<String>,
    /// Expiry of stored objects (`SET ... PX`, whole milliseconds). Default none (no expiry).
    #[serde(deserialize_with = "de_opt_duration")]
    pub ttl: Option<Duration>,
    /// Prepended to every key. Must not contain `{` or `}`. Default `"ub:"`.
    pub key_prefix: String,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            nodes: vec!["127.0.0.1:6379".to_string()],
            timeout: Duration::from_millis(20),
            connect_timeout: Duration::from_millis(100),
            password: None,
            ttl: None,
            key_prefix: "ub:".to_string(),
        }
    }
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("nodes", &self.nodes)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("ttl", &self.ttl)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}

impl StoreConfig {
    /// Checks the configuration; the error names the offending key and says what is expected.
    pub fn validate(&self) -> Result<(), String> {
        if self.nodes.is_empty() {
            return Err("store: nodes is empty: give at least one \"host:port\" seed".into());
        }
        for (i, n) in self.nodes.iter().enumerate() {
            parse_host_port(n).map_err(|e| format!("store: nodes[{i}] = {n:?}: {e}"))?;
        }
        for (name, d) in [
            ("timeout", self.timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("store: {name} is zero; it must be positive"));
            }
            if d > Duration::from_secs(60) {
                return Err(format!(
                    "store: {name} = {d:?} is above the maximum of 60 s"
                ));
            }
        }
        if let Some(ttl) = self.ttl {
            if ttl < Duration::from_millis(1) {
                return Err(format!(
                    "store: ttl = {ttl:?} is below 1 ms (SET PX counts whole milliseconds); \
                     omit ttl for keys that never expire"
                ));
            }
        }
        if self.password.as_deref() == Some("") {
            return Err("store: password is empty; omit it to skip AUTH".into());
        }
        if self.key_prefix.contains(['{', '}']) {
            return Err(format!(
                "store: key_prefix = {:?} contains '{{' or '}}': a hash tag in the prefix would put \
                 every key in the same cluster slot",
                self.key_prefix
            ));
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum DurationRepr {
    Millis(u64),
    Text(String),
}

impl DurationRepr {
    fn into_duration(self) -> Result<Duration, String> {
        match self {
            DurationRepr::Millis(ms) => Ok(Duration::from_millis(ms)),
            DurationRepr::Text(s) => parse_duration(&s),
        }
    }
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    DurationRepr::deserialize(d)?
        .into_duration()
        .map_err(serde::de::Error::custom)
}

fn de_opt_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    match Option::<DurationRepr>::deserialize(d)? {
        None => Ok(None),
        Some(r) => r
            .into_duration()
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

/// Parses `"20ms"`, `"1.5s"`, `"500us"`, `"10m"`, `"1h"`, `"250ns"`; a bare number is milliseconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    let bad = || {
        format!(
            "bad duration {text:?}: expected e.g. \"20ms\", \"1.5s\" or an integer of milliseconds"
        )
    };
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let nanos_per_unit: u64 = match unit.trim() {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "" | "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" | "min" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return Err(bad()),
    };
    if num.is_empty() {
        return Err(bad());
    }
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(nanos_per_unit)
            .map(Duration::from_nanos)
            .ok_or_else(bad);
    }
    let v: f64 = num.parse().map_err(|_| bad())?;
    let ns = v * nanos_per_unit as f64;
    if !ns.is_finite() || ns < 0.0 || ns > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(Duration::from_nanos(ns.round() as u64))
}

/// Splits `"host:port"` or `"[v6]:port"`.
fn parse_host_port(s: &str) -> Result<(String, u16), String> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest.split_once("]:").ok_or("expected \"[ipv6]:port\"")?;
        (h, p)
    } else {
        let (h, p) = s.rsplit_once(':').ok_or("expected \"host:port\"")?;
        if h.contains(':') {
            return Err("write an IPv6 address as \"[addr]:port\"".into());
        }
        (h, p)
    };
    if host.is_empty() {
        return Err("empty host, expected \"host:port\"".into());
    }
    let port: u16 = port.parse().map_err(|_| format!("bad port {port:?}"))?;
    if port == 0 {
        return Err("port 0".into());
    }
    Ok((host.to_string(), port))
}

/// Resolves the seeds; the error lists every seed that does not resolve when none does.
fn resolve_seeds(nodes: &[String]) -> Result<Vec<SocketAddr>, String> {
    let mut out = Vec::new();
    let mut errs = Vec::new();
    for n in nodes {
        let resolved = parse_host_port(n).and_then(|(h, p)| {
            (h.as_str(), p)
                .to_socket_addrs()
                .map_err(|e| e.to_string())?
                .next()
                .ok_or_else(|| "no address".to_string())
        });
        match resolved {
            Ok(a) if !out.contains(&a) => out.push(a),
            Ok(_) => {}
            Err(e) => errs.push(format!("{n}: {e}")),
        }
    }
    if out.is_empty() {
        return Err(format!("no store seed resolves ({})", errs.join("; ")));
    }
    Ok(out)
}

// ------------------------------------------------------------------------------------------
// Errors and replies
// ------------------------------------------------------------------------------------------

/// Why a store operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The store did not answer within [`StoreConfig::timeout`]. The operation may or may not
    /// have been applied.
    Timeout,
    /// The store is unreachable (connection refused, reset or closed, node marked down, request
    /// queue full). The text says which.
    Down(String),
    /// The store answered something that is not valid RESP2, or not the reply expected.
    Protocol(String),
    /// The store answered with an error reply (`-ERR ...`, `-CLUSTERDOWN ...`, `-OOM ...`).
    Server(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => write!(f, "store operation timed out"),
            StoreError::Down(s) => write!(f, "store down: {s}"),
            StoreError::Protocol(s) => write!(f, "store protocol error: {s}"),
            StoreError::Server(s) => write!(f, "store error reply: {s}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// A short description of a reply for error messages (never the whole of a big value).
fn describe(r: &Reply) -> String {
    match r {
        Reply::Status(s) => format!("+{}", truncate(s)),
        Reply::Error(s) => format!("-{}", truncate(s)),
        Reply::Int(n) => format!(":{n}"),
        Reply::Bulk(None) => "null bulk".into(),
        Reply::Bulk(Some(b)) => format!("bulk of {} bytes", b.len()),
        Reply::Array(None) => "null array".into(),
        Reply::Array(Some(a)) => format!("array of {}", a.len()),
    }
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(80) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

// ------------------------------------------------------------------------------------------
// Cluster helpers
// ------------------------------------------------------------------------------------------

const fn crc16_table() -> [u16; 256] {
    let mut t = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = (i as u16) << 8;
        let mut j = 0;
        while j < 8 {
            c = if c & 0x8000 != 0 {
                (c << 1) ^ 0x1021
            } else {
                c << 1
            };
            j += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

static CRC16_TABLE: [u16; 256] = crc16_table();

fn crc16_update(mut crc: u16, data: &[u8]) -> u16 {
    for &b in data {
        crc = (crc << 8) ^ CRC16_TABLE[(((crc >> 8) as u8) ^ b) as usize];
    }
    crc
}

/// CRC16/XMODEM (polynomial 0x1021, initial 0), the checksum Redis Cluster hashes keys with.
pub fn crc16(data: &[u8]) -> u16 {
    crc16_update(0, data)
}

/// The hash tag of a key: the bytes between its first `{` and the next `}`, if not empty.
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let len = key[open + 1..].iter().position(|&b| b == b'}')?;
    (len > 0).then(|| &key[open + 1..open + 1 + len])
}

/// The Redis Cluster hash slot of `key` (0..16384), honouring `{hash tags}`.
pub fn key_slot(key: &[u8]) -> u16 {
    match hash_tag(key) {
        Some(tag) => crc16(tag) & (SLOTS as u16 - 1),
        None => crc16(key) & (SLOTS as u16 - 1),
    }
}

/// The slot of `prefix ++ key` for a prefix without braces (what [`StoreConfig::validate`]
/// enforces), without building the full key.
fn prefixed_slot(prefix: &[u8], key: &[u8]) -> u16 {
    debug_assert!(!prefix.contains(&b'{'));
    match hash_tag(key) {
        Some(tag) => crc16(tag) & (SLOTS as u16 - 1),
        None => crc16_update(crc16(prefix), key) & (SLOTS as u16 - 1),
    }
}

/// Resolves a node address as Redis reports it; an empty or `?` host means the node asked.
fn resolve_node(host: &str, port: u16, asked: IpAddr) -> Option<SocketAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host == "?" {
        return Some(SocketAddr::new(asked, port));
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, port));
    }
    (host, port).to_socket_addrs().ok()?.next()
}

/// `CLUSTER SLOTS` reply to `(first, last, master)` ranges.
fn parse_cluster_slots(
    reply: &Reply,
    asked: SocketAddr,
) -> Result<Vec<(u16, u16, SocketAddr)>, String> {
    let Reply::Array(Some(items)) = reply else {
        return Err(format!(
            "CLUSTER SLOTS: expected an array, got {}",
            describe(reply)
        ));
    };
    let mut out = Vec::with_capacity(items.len());
    for it in items {
        let bad = || format!("CLUSTER SLOTS: malformed entry {}", describe(it));
        let Reply::Array(Some(f)) = it else {
            return Err(bad());
        };
        let (Some(Reply::Int(a)), Some(Reply::Int(b)), Some(Reply::Array(Some(master)))) =
            (f.first(), f.get(1), f.get(2))
        else {
            return Err(bad());
        };
        let (Some(Reply::Bulk(Some(host))), Some(Reply::Int(port))) =
            (master.first(), master.get(1))
        else {
            return Err(bad());
        };
        if !(0..SLOTS as i64).contains(a)
            || !(*a..SLOTS as i64).contains(b)
            || !(1..=65535).contains(port)
        {
            return Err(bad());
        }
        let host = String::from_utf8_lossy(host);
        let addr = resolve_node(&host, *port as u16, asked.ip())
            .ok_or_else(|| format!("CLUSTER SLOTS: cannot resolve {host}:{port}"))?;
        out.push((*a as u16, *b as u16, addr));
    }
    Ok(out)
}

/// A `-MOVED slot host:port` or `-ASK slot host:port` error reply.
struct Redirect {
    ask: bool,
    slot: u16,
    host: String,
    port: u16,
}

fn parse_redirect(msg: &str) -> Option<Redirect> {
    let mut it = msg.split_ascii_whitespace();
    let ask = match it.next()? {
        "MOVED" => false,
        "ASK" => true,
        _ => return None,
    };
    let slot: u16 = it.next()?.parse().ok().filter(|&s| (s as usize) < SLOTS)?;
    let (host, port) = it.next()?.rsplit_once(':')?;
    Some(Redirect {
        ask,
        slot,
        host: host.to_string(),
        port: port.parse().ok()?,
    })
}

// ------------------------------------------------------------------------------------------
// Blocking client
// ------------------------------------------------------------------------------------------

fn io_error(e: &io::Error, what: &str, addr: SocketAddr) -> StoreError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => StoreError::Timeout,
        _ => StoreError::Down(format!("{what} {addr}: {e}")),
    }
}

/// A blocking connection to one node.
struct SyncConn {
    addr: SocketAddr,
    sock: TcpStream,
    buf: Vec<u8>,
    pos: usize,
}

impl SyncConn {
    fn open(addr: SocketAddr, cfg: &StoreConfig) -> Result<SyncConn, StoreError> {
        let sock =
            TcpStream::connect_timeout(&addr, cfg.connect_timeout).map_err(|e| match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => StoreError::Down(format!(
                    "connect to {addr}: timed out after {:?}",
                    cfg.connect_timeout
                )),
                _ => StoreError::Down(format!("connect to {addr}: {e}")),
            })?;
        let _ = sock.set_nodelay(true);
        let mut c = SyncConn {
            addr,
            sock,
            buf: Vec::new(),
            pos: 0,
        };
        if let Some(pw) = &cfg.password {
            let deadline = Instant::now() + cfg.connect_timeout.max(cfg.timeout);
            if let Some(Reply::Error(m)) =
                c.roundtrip(&[&[b"AUTH", pw.as_bytes()]], deadline)?.pop()
            {
                return Err(StoreError::Server(format!("AUTH at {addr}: {m}")));
            }
        }
        Ok(c)
    }

    /// Writes all commands in one write, then reads one reply per command.
    fn roundtrip(
        &mut self,
        cmds: &[&[&[u8]]],
        deadline: Instant,
    ) -> Result<Vec<Reply>, StoreError> {
        let mut out = Vec::new();
        for c in cmds {
            encode_command(&mut out, c);
        }
        let left = remaining(deadline)?;
        self.sock
            .set_write_timeout(Some(left))
            .map_err(|e| io_error(&e, "write to", self.addr))?;
        self.sock
            .write_all(&out)
            .map_err(|e| io_error(&e, "write to", self.addr))?;
        (0..cmds.len()).map(|_| self.recv(deadline)).collect()
    }

    fn recv(&mut self, deadline: Instant) -> Result<Reply, StoreError> {
        let mut tmp = [0u8; 64 * 1024];
        loop {
            if let Some((r, used)) =
                parse_reply(&self.buf[self.pos..]).map_err(StoreError::Protocol)?
            {
                self.pos += used;
                if self.pos == self.buf.len() {
                    self.buf.clear();
                    self.pos = 0;
                }
                return Ok(r);
            }
            let left = remaining(deadline)?;
            self.sock
                .set_read_timeout(Some(left))
                .map_err(|e| io_error(&e, "read from", self.addr))?;
            match self.sock.read(&mut tmp) {
                Ok(0) => {
                    return Err(StoreError::Down(format!(
                        "{} closed the connection",
                        self.addr
                    )))
                }
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_error(&e, "read from", self.addr)),
            }
        }
    }
}

fn remaining(deadline: Instant) -> Result<Duration, StoreError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(StoreError::Timeout)
    } else {
        Ok(left)
    }
}

/// A blocking store client: one request at a time, each bounded by [`StoreConfig::timeout`]
/// (per round trip; a redirection starts a new one). Connections are opened on demand
/// (bounded by [`StoreConfig::connect_timeout`]) and dropped after any error, so the next call
/// reconnects. Not for the packet loop: use [`StoreHandle`] there.
pub struct Store {
    cfg: StoreConfig,
    seeds: Vec<SocketAddr>,
    conns: HashMap<SocketAddr, SyncConn>,
    /// Slot owners when the store is a cluster; `None` for a single node.
    slots: Option<Vec<Option<SocketAddr>>>,
    single: SocketAddr,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("seeds", &self.seeds)
            .field("cluster", &self.slots.is_some())
            .field("single", &self.single)
            .finish()
    }
}

impl Store {
    /// Validates `cfg`, then finds the store: the first seed that answers decides whether it is
    /// a single node or a cluster (`CLUSTER SLOTS`). Fails with [`StoreError::Down`] when the
    /// configuration is invalid or no seed answers.
    pub fn connect(cfg: &StoreConfig) -> Result<Store, StoreError> {
        cfg.validate()
            .map_err(|e| StoreError::Down(format!("invalid configuration: {e}")))?;
        let seeds = resolve_seeds(&cfg.nodes).map_err(StoreError::Down)?;
        let mut store = Store {
            cfg: cfg.clone(),
            single: seeds[0],
            seeds,
            conns: HashMap::new(),
            slots: None,
        };
        let mut errs = Vec::new();
        for seed in store.seeds.clone() {
            match store.discover(seed) {
                Ok(()) => return Ok(store),
                Err(e) => errs.push(format!("{seed}: {e}")),
            }
        }
        Err(StoreError::Down(format!(
            "no store node answers ({})",
            errs.join("; ")
        )))
    }

    /// Whether the store is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.slots.is_some()
    }

    /// Asks `addr` for `CLUSTER SLOTS` and adopts the answer.
    fn discover(&mut self, addr: SocketAddr) -> Result<(), StoreError> {
        let reply = self
            .roundtrip(addr, &[&[b"CLUSTER", b"SLOTS"]])?
            .pop()
            .unwrap_or(Reply::Array(None));
        match &reply {
            Reply::Array(Some(items)) if !items.is_empty() => {
                let ranges = parse_cluster_slots(&reply, addr).map_err(StoreError::Protocol)?;
                let mut table = vec![None; SLOTS];
                for (a, b, node) in ranges {
                    for s in a..=b {
                        table[s as usize] = Some(node);
                    }
                }
                self.slots = Some(table);
            }
            // Not a cluster ("ERR This instance has cluster support disabled"), or a cluster
            // node without slots: a single node.
            _ => {
                if self.slots.is_none() {
                    self.single = addr;
                }
            }
        }
        Ok(())
    }

    fn roundtrip(&mut self, addr: SocketAddr, cmds: &[&[&[u8]]]) -> Result<Vec<Reply>, StoreError> {
        if !self.conns.contains_key(&addr) {
            let c = SyncConn::open(addr, &self.cfg)?;
            self.conns.insert(addr, c);
        }
        let conn = self.conns.get_mut(&addr).expect("inserted above");
        let r = conn.roundtrip(cmds, Instant::now() + self.cfg.timeout);
        if r.is_err() {
            self.conns.remove(&addr);
        }
        r
    }

    fn route(&self, key: Option<&[u8]>) -> SocketAddr {
        match (&self.slots, key) {
            (Some(table), Some(k)) => table[key_slot(k) as usize]
                .or_else(|| table.iter().flatten().next().copied())
                .unwrap_or(self.single),
            (Some(table), None) => table
                .iter()
                .flatten()
                .next()
                .copied()
                .unwrap_or(self.single),
            (None, _) => self.single,
        }
    }

    /// Runs one command routed by `key`, following redirections.
    fn exec(&mut self, key: Option<&[u8]>, args: &[&[u8]]) -> Result<Reply, StoreError> {
        let mut asking: Option<SocketAddr> = None;
        for _ in 0..=MAX_REDIRECTS {
            let addr = asking.unwrap_or_else(|| self.route(key));
            let reply = if asking.is_some() {
                self.roundtrip(addr, &[&[b"ASKING"], args])?.pop()
            } else {
                self.roundtrip(addr, &[args])?.pop()
            };
            let reply = reply.ok_or_else(|| StoreError::Protocol("no reply".into()))?;
            let Reply::Error(msg) = reply else {
                return Ok(reply);
            };
            let Some(r) = parse_redirect(&msg) else {
                return Err(StoreError::Server(msg));
            };
            let target = resolve_node(&r.host, r.port, addr.ip())
                .ok_or_else(|| StoreError::Server(format!("{msg} (cannot resolve the target)")))?;
            if r.ask {
                asking = Some(target);
            } else {
                asking = None;
                let table = self.slots.get_or_insert_with(|| vec![Some(addr); SLOTS]);
                table[r.slot as usize] = Some(target);
                // Best effort: the whole map probably changed.
                let _ = self.discover(target);
            }
        }
        Err(StoreError::Server("too many redirections".into()))
    }

    fn full_key(&self, key: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.cfg.key_prefix.len() + key.len());
        k.extend_from_slice(self.cfg.key_prefix.as_bytes());
        k.extend_from_slice(key);
        k
    }

    /// Stores `val` under `key_prefix ++ key` (with `PX ttl` when configured).
    pub fn set(&mut self, key: &[u8], val: &[u8]) -> Result<(), StoreError> {
        let k = self.full_key(key);
        let ttl = self.cfg.ttl.map(|t| t.as_millis().to_string());
        let reply = match &ttl {
            Some(ms) => self.exec(Some(&k), &[b"SET", &k, val, b"PX", ms.as_bytes()])?,
            None => self.exec(Some(&k), &[b"SET", &k, val])?,
        };
        match reply {
            Reply::Status(s) if s == "OK" => Ok(()),
            r => Err(StoreError::Protocol(format!(
                "unexpected reply to SET: {}",
                describe(&r)
            ))),
        }
    }

    /// The value under `key_prefix ++ key`, `None` if there is none.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let k = self.full_key(key);
        match self.exec(Some(&k), &[b"GET", &k])? {
            Reply::Bulk(v) => Ok(v),
            r => Err(StoreError::Protocol(format!(
                "unexpected reply to GET: {}",
                describe(&r)
            ))),
        }
    }

    /// Deletes `key_prefix ++ key`; true if it existed.
    pub fn del(&mut self, key: &[u8]) -> Result<bool, StoreError> {
        let k = self.full_key(key);
        match self.exec(Some(&k), &[b"DEL", &k])? {
            Reply::Int(n) => Ok(n > 0),
            r => Err(StoreError::Protocol(format!(
                "unexpected reply to DEL: {}",
                describe(&r)
            ))),
        }
    }

    /// `PING`s the node (every master of a cluster).
    pub fn ping(&mut self) -> Result<(), StoreError> {
        for addr in self.masters() {
            match self.roundtrip(addr, &[&[b"PING"]])?.pop() {
                Some(Reply::Status(s)) if s == "PONG" => {}
                Some(Reply::Error(m)) => return Err(StoreError::Server(m)),
                r => {
                    return Err(StoreError::Protocol(format!(
                        "unexpected reply to PING: {}",
                        r.as_ref().map_or("none".into(), describe)
                    )))
                }
            }
        }
        Ok(())
    }

    /// The nodes commands go to: every master of a cluster, or the single node.
    pub fn masters(&self) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = match &self.slots {
            Some(table) => table.iter().flatten().copied().collect(),
            None => vec![self.single],
        };
        v.sort();
        v.dedup();
        v
    }

    /// Runs a raw command on one node (from [`masters`](Self::masters)), without routing or
    /// redirection: for per-node commands such as `SCAN` or `DBSIZE` on a cluster. An error
    /// reply is returned as [`StoreError::Server`].
    pub fn command_at(&mut self, node: SocketAddr, args: &[&[u8]]) -> Result<Reply, StoreError> {
        match self.roundtrip(node, &[args])?.pop() {
            Some(Reply::Error(m)) => Err(StoreError::Server(m)),
            Some(r) => Ok(r),
            None => Err(StoreError::Protocol("no reply".into())),
        }
    }

    /// Runs a raw command (no key prefix), routed in a cluster by `args[1]` as the key and
    /// following redirections. An error reply is returned as [`StoreError::Server`].
    pub fn command(&mut self, args: &[&[u8]]) -> Result<Reply, StoreError> {
        match self.exec(args.get(1).copied(), args)? {
            Reply::Error(m) => Err(StoreError::Server(m)),
            r => Ok(r),
        }
    }
}

// ------------------------------------------------------------------------------------------
// Asynchronous front end
// ------------------------------------------------------------------------------------------

/// One operation for [`StoreHandle::submit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    /// Caller's tag, returned in the [`Completion`].
    pub token: u64,
    /// What to do.
    pub kind: OpKind,
}

/// The operations. Keys get [`StoreConfig::key_prefix`] prepended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpKind {
    /// `SET key val` (`PX ttl` when configured); completes with `Ok(None)`.
    Set {
        /// Key, without the prefix.
        key: Vec<u8>,
        /// Value, any bytes.
        val: Vec<u8>,
    },
    /// `GET key`; completes with `Ok(Some(value))`, or `Ok(None)` when there is no such key.
    Get {
        /// Key, without the prefix.
        key: Vec<u8>,
    },
    /// `DEL key`; completes with `Ok(None)` whether or not the key existed.
    Del {
        /// Key, without the prefix.
        key: Vec<u8>,
    },
}

impl OpKind {
    /// The store key the operation acts on.
    pub fn key(&self) -> &[u8] {
        match self {
            OpKind::Set { key, .. } | OpKind::Get { key } | OpKind::Del { key } => key,
        }
    }
}

/// The outcome of one submitted [`Op`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The op's token.
    pub token: u64,
    /// `Ok(None)` for `Set` and `Del`, `Ok(value)` for `Get`, or why it failed.
    pub result: Result<Option<Vec<u8>>, StoreError>,
    /// From [`StoreHandle::submit`] to completion by the worker.
    pub latency: Duration,
}

/// Counters of a [`StoreHandle`], from [`StoreHandle::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Operations submitted.
    pub ops: u64,
    /// Operations completed (equal to `ops` once nothing is in flight).
    pub completed: u64,
    /// Completions with an error (every kind, including timeouts and fast failures).
    pub errors: u64,
    /// Completions with [`StoreError::Timeout`].
    pub timeouts: u64,
    /// Operations failed at once with [`StoreError::Down`], without touching the network,
    /// because their node was marked down or the queue was full.
    pub fast_fails: u64,
    /// Of `fast_fails`: submissions refused because the request queue was full.
    pub queue_full: u64,
    /// Successful reconnections to a node that had been marked down.
    pub reconnects: u64,
    /// `-MOVED` and `-ASK` redirections followed.
    pub redirects: u64,
    /// Largest completion latency seen.
    pub max_latency: Duration,
}

#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    completed: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    fast_fails: AtomicU64,
    queue_full: AtomicU64,
    reconnects: AtomicU64,
    redirects: AtomicU64,
    max_latency_ns: AtomicU64,
}

const MODE_NONE: u8 = 0;
const MODE_SINGLE: u8 = 1;
const MODE_CLUSTER: u8 = 2;

/// State shared by the handle (the packet loop's thread) and the worker.
struct Shared {
    /// `MODE_*`: no node reached yet, single node, cluster.
    mode: AtomicU8,
    /// Single node: the node is down. Cluster: the node of at least one slot is down.
    down: AtomicBool,
    /// Cluster: per slot, its node is down (ops for it fail fast in `submit`).
    slot_down: Box<[AtomicBool]>,
    prefix: Vec<u8>,
    /// Wakes the worker: written by `submit` when `worker_notified` was clear.
    worker_fd: OwnedFd,
    worker_notified: AtomicBool,
    /// Readable while completions are pending: written when `wake_signaled` was clear.
    wake_fd: OwnedFd,
    wake_signaled: AtomicBool,
    shutdown: AtomicBool,
    /// Completions not yet taken. Held only to push or take, never across I/O.
    done: Mutex<VecDeque<Completion>>,
    c: Counters,
}

fn new_eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd has no memory arguments; the result is checked before use.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a freshly created descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn eventfd_add(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64. Failure (counter overflow) leaves it readable.
    unsafe { libc::write(fd, &one as *const u64 as *const libc::c_void, 8) };
}

fn eventfd_clear(fd: RawFd) {
    let mut v: u64 = 0;
    // SAFETY: reads at most 8 bytes into a live u64; EAGAIN (already clear) is fine.
    unsafe { libc::read(fd, &mut v as *mut u64 as *mut libc::c_void, 8) };
}

impl Shared {
    fn record(&self, result: &Result<Option<Vec<u8>>, StoreError>, latency: Duration, fast: bool) {
        let c = &self.c;
        c.completed.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = result {
            c.errors.fetch_add(1, Ordering::Relaxed);
            if *e == StoreError::Timeout {
                c.timeouts.fetch_add(1, Ordering::Relaxed);
            }
            if fast {
                c.fast_fails.fetch_add(1, Ordering::Relaxed);
            }
        }
        c.max_latency_ns.fetch_max(
            latency.as_nanos().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    fn done(&self) -> MutexGuard<'_, VecDeque<Completion>> {
        self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn signal_completions(&self) {
        if !self.wake_signaled.swap(true, Ordering::SeqCst) {
            eventfd_add(self.wake_fd.as_raw_fd());
        }
    }

    fn notify_worker(&self) {
        if !self.worker_notified.swap(true, Ordering::SeqCst) {
            eventfd_add(self.worker_fd.as_raw_fd());
        }
    }
}

struct Queued {
    op: Op,
    at: Instant,
}

/// Asynchronous store client for the packet loop.
///
/// [`submit`](Self::submit) never blocks: it queues the operation for the worker thread (a
/// bounded queue of [`QUEUE_CAPACITY`]), or, when the queue is full or the operation's node is
/// known to be down, completes it at once with [`StoreError::Down`] so the caller can fall
/// back. The worker writes all queued commands of a node in one write and matches the replies
/// in order. Each operation completes exactly once, within [`StoreConfig::timeout`] of its
/// submission (plus scheduling delays): successes, error replies, timeouts and failures alike,
/// also across reconnections.
///
/// Down detection: any failure on a node's connection (refused, reset, closed, a timeout, a
/// protocol error) fails what was in flight on it and marks the node down; its operations then
/// fail fast until a reconnection attempt (every [`RECONNECT_INTERVAL`], each bounded by
/// [`StoreConfig::connect_timeout`], `AUTH` + `PING` + `CLUSTER SLOTS`) succeeds.
///
/// Completions are collected with [`try_recv`](Self::try_recv) or [`drain`](Self::drain);
/// [`wake_fd`](Self::wake_fd) polls readable while some are pending. The handle is `Send` and
/// `Sync` (`stats` and `is_down` from a status thread, say); completions are meant for one
/// consumer. Dropping it stops the worker; operations still in flight then never complete.
pub struct StoreHandle {
    shared: Arc<Shared>,
    tx: mpsc::SyncSender<Queued>,
    worker: Option<JoinHandle<()>>,
}

impl fmt::Debug for StoreHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreHandle")
            .field("stats", &self.stats())
            .finish()
    }
}

impl StoreHandle {
    /// Validates `cfg`, starts the worker thread and waits (at most about
    /// [`StoreConfig::connect_timeout`]) for the first node to answer. A store that is down
    /// does not fail the start: the handle starts in the down state (every operation fails
    /// fast) and keeps trying to connect. Errors: an invalid configuration or no resolvable
    /// seed (`InvalidInput`), or no eventfd or thread.
    pub fn start(cfg: &StoreConfig) -> io::Result<StoreHandle> {
        let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidInput, e);
        cfg.validate().map_err(invalid)?;
        let seeds = resolve_seeds(&cfg.nodes).map_err(invalid)?;
        let shared = Arc::new(Shared {
            mode: AtomicU8::new(MODE_NONE),
            down: AtomicBool::new(true),
            slot_down: (0..SLOTS).map(|_| AtomicBool::new(false)).collect(),
            prefix: cfg.key_prefix.as_bytes().to_vec(),
            worker_fd: new_eventfd()?,
            worker_notified: AtomicBool::new(false),
            wake_fd: new_eventfd()?,
            wake_signaled: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            done: Mutex::new(VecDeque::new()),
            c: Counters::default(),
        });
        let (tx, rx) = mpsc::sync_channel(QUEUE_CAPACITY);
        let (ready_tx, ready_rx) = mpsc::channel();
        let worker = Worker::new(cfg, &seeds, shared.clone(), rx, ready_tx);
        let worker = thread::Builder::new()
            .name("ub-store".into())
            .spawn(move || worker.run())?;
        let _ = ready_rx.recv_timeout(cfg.connect_timeout + Duration::from_millis(50));
        Ok(StoreHandle {
            shared,
            tx,
            worker: Some(worker),
        })
    }

    /// Why an op for `key` would fail right now without touching the network.
    fn fast_fail(&self, key: &[u8]) -> Option<String> {
        let sh = &self.shared;
        match sh.mode.load(Ordering::Acquire) {
            MODE_SINGLE => sh
                .down
                .load(Ordering::Relaxed)
                .then(|| "store node is down".to_string()),
            MODE_CLUSTER => {
                let slot = prefixed_slot(&sh.prefix, key);
                sh.slot_down[slot as usize]
                    .load(Ordering::Relaxed)
                    .then(|| format!("store node of hash slot {slot} is down"))
            }
            _ => Some("no store node reachable".to_string()),
        }
    }

    fn complete_now(&self, token: u64, at: Instant, err: StoreError) {
        let latency = at.elapsed();
        let result = Err(err);
        self.shared.record(&result, latency, true);
        self.shared.done().push_back(Completion {
            token,
            result,
            latency,
        });
        self.shared.signal_completions();
    }

    /// Submits an operation; never blocks. Returns true if it was queued for the worker, false
    /// if it was completed at once with [`StoreError::Down`] (queue full, node known down):
    /// that completion is already waiting in [`try_recv`](Self::try_recv) /
    /// [`drain`](Self::drain). Either way the op completes exactly once.
    pub fn submit(&self, op: Op) -> bool {
        let at = Instant::now();
        self.shared.c.ops.fetch_add(1, Ordering::Relaxed);
        if let Some(why) = self.fast_fail(op.kind.key()) {
            self.complete_now(op.token, at, StoreError::Down(why));
            return false;
        }
        match self.tx.try_send(Queued { op, at }) {
            Ok(()) => {
                self.shared.notify_worker();
                true
            }
            Err(mpsc::TrySendError::Full(q)) => {
                self.shared.c.queue_full.fetch_add(1, Ordering::Relaxed);
                self.complete_now(
                    q.op.token,
                    at,
                    StoreError::Down(format!("request queue full ({QUEUE_CAPACITY} ops)")),
                );
                false
            }
            Err(mpsc::TrySendError::Disconnected(q)) => {
                self.complete_now(
                    q.op.token,
                    at,
                    StoreError::Down("store worker stopped".into()),
                );
                false
            }
        }
    }

    /// Resets the wake fd. The fd is read before the flag is cleared: the other order could
    /// swallow a signal sent in between and leave the flag set, so that no later completion
    /// would signal again (a lost wake-up).
    fn clear_wake(&self) {
        eventfd_clear(self.shared.wake_fd.as_raw_fd());
        self.shared.wake_signaled.store(false, Ordering::SeqCst);
    }

    /// Takes one completion, if any. A call that returns `None` also resets
    /// [`wake_fd`](Self::wake_fd).
    pub fn try_recv(&self) -> Option<Completion> {
        if let Some(c) = self.shared.done().pop_front() {
            return Some(c);
        }
        self.clear_wake();
        // A completion that arrived before the reset is taken here; any later one sets the fd.
        self.shared.done().pop_front()
    }

    /// Resets [`wake_fd`](Self::wake_fd), then appends every pending completion to `out`.
    /// Returns how many were appended.
    pub fn drain(&self, out: &mut Vec<Completion>) -> usize {
        self.clear_wake();
        let mut q = self.shared.done();
        let n = q.len();
        out.extend(q.drain(..));
        n
    }

    /// An eventfd that polls readable (`POLLIN`) while completions are pending, for `poll()`
    /// next to the caller's other descriptors. To clear it, take the completions with
    /// [`drain`](Self::drain), or with [`try_recv`](Self::try_recv) until it returns `None`:
    /// both reset it before taking, so no completion is ever left behind unsignalled. It may
    /// poll readable once with nothing pending (a completion taken by the same `drain` that
    /// reset it); that is harmless. Do not read or close the fd yourself: reading it directly
    /// would bypass the handle's signalling state and could lose later wake-ups.
    pub fn wake_fd(&self) -> RawFd {
        self.shared.wake_fd.as_raw_fd()
    }

    /// True while some operations fail fast: no node reachable, the (single) node down, or,
    /// for a cluster, the node of at least one slot down.
    pub fn is_down(&self) -> bool {
        self.shared.mode.load(Ordering::Acquire) == MODE_NONE
            || self.shared.down.load(Ordering::Relaxed)
    }

    /// Whether the store was found to be a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.shared.mode.load(Ordering::Acquire) == MODE_CLUSTER
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StoreStats {
        let c = &self.shared.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreStats {
            ops: l(&c.ops),
            completed: l(&c.completed),
            errors: l(&c.errors),
            timeouts: l(&c.timeouts),
            fast_fails: l(&c.fast_fails),
            queue_full: l(&c.queue_full),
            reconnects: l(&c.reconnects),
            redirects: l(&c.redirects),
            max_latency: Duration::from_nanos(l(&c.max_latency_ns)),
        }
    }
}

impl Drop for StoreHandle {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        eventfd_add(self.shared.worker_fd.as_raw_fd());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

// ------------------------------------------------------------------------------------------
// The worker
// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Set,
    Get,
    Del,
}

/// A user operation inside the worker.
struct UserOp {
    token: u64,
    cmd: Cmd,
    key: Vec<u8>,
    val: Vec<u8>,
    at: Instant,
    deadline: Instant,
    redirects: u8,
}

/// What a reply on a connection answers.
enum What {
    User(UserOp),
    Auth,
    Ping,
    Slots { probe: bool },
    Asking,
}

struct Pending {
    seq: u64,
    what: What,
}

/// Why a connection was given up.
enum Failure {
    Timeout,
    Down(String),
    Protocol(String),
}

impl Failure {
    fn error(&self) -> StoreError {
        match self {
            Failure::Timeout => StoreError::Timeout,
            Failure::Down(s) => StoreError::Down(s.clone()),
            Failure::Protocol(s) => StoreError::Protocol(s.clone()),
        }
    }
}

/// A non-blocking connection to one node, with its request pipeline.
struct Conn {
    id: u64,
    sock: TcpStream,
    connecting: bool,
    /// A reconnection attempt: the node stays down until its `CLUSTER SLOTS` is answered.
    probe: bool,
    out: Vec<u8>,
    out_pos: usize,
    inb: Vec<u8>,
    in_pos: usize,
    /// Requests sent (or buffered), oldest first: replies match them in order.
    pending: VecDeque<Pending>,
    /// Sliding-window minimum of the pending deadlines: `(seq, deadline)`, increasing.
    mins: VecDeque<(u64, Instant)>,
}

impl Conn {
    fn push(&mut self, seq: u64, deadline: Instant, what: What) {
        while self.mins.back().is_some_and(|&(_, d)| d > deadline) {
            self.mins.pop_back();
        }
        self.mins.push_back((seq, deadline));
        self.pending.push_back(Pending { seq, what });
    }

    fn pop(&mut self) -> Option<Pending> {
        let p = self.pending.pop_front()?;
        if self.mins.front().is_some_and(|&(s, _)| s == p.seq) {
            self.mins.pop_front();
        }
        Some(p)
    }

    fn earliest(&self) -> Option<Instant> {
        self.mins.front().map(|&(_, d)| d)
    }

    /// Writes what is buffered (one write while the socket takes it all).
    fn flush(&mut self) -> io::Result<()> {
        if self.connecting {
            return Ok(());
        }
        while self.out_pos < self.out.len() {
            match self.sock.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        } else if self.out_pos > (1 << 20) {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
        Ok(())
    }

    /// Reads what is there and parses the complete replies, pairing each with its request.
    /// Returns true at end of stream.
    fn read_replies(
        &mut self,
        scratch: &mut [u8],
        replies: &mut Vec<(Pending, Reply)>,
    ) -> Result<bool, Failure> {
        let mut eof = false;
        loop {
            match self.sock.read(scratch) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    self.inb.extend_from_slice(&scratch[..n]);
                    if n < scratch.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Failure::Down(format!("read: {e}"))),
            }
        }
        loop {
            match parse_reply(&self.inb[self.in_pos..]) {
                Ok(Some((r, used))) => {
                    self.in_pos += used;
                    let p = self
                        .pop()
                        .ok_or_else(|| Failure::Protocol("reply without a request".into()))?;
                    replies.push((p, r));
                }
                Ok(None) => break,
                Err(e) => return Err(Failure::Protocol(e)),
            }
        }
        if self.in_pos == self.inb.len() {
            self.inb.clear();
            self.in_pos = 0;
        } else if self.in_pos > (1 << 20) {
            self.inb.drain(..self.in_pos);
            self.in_pos = 0;
        }
        Ok(eof)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeState {
    /// Known (from the slot map or a redirection) but not connected yet; assumed up.
    Idle,
    /// Connected (or connecting on first use).
    Up,
    /// Failed; operations fail fast; reconnection attempts every `RECONNECT_INTERVAL`.
    Down,
}

struct Node {
    addr: SocketAddr,
    seed: bool,
    /// Owns slots in the current map.
    in_map: bool,
    state: NodeState,
    conn: Option<Conn>,
    next_probe: Instant,
    probe_started: Instant,
    ever_up: bool,
    probed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    None,
    Single,
    Cluster,
}

struct Worker {
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Queued>,
    ready_tx: Option<mpsc::Sender<()>>,
    timeout: Duration,
    connect_timeout: Duration,
    password: Option<Vec<u8>>,
    ttl_ms: Option<Vec<u8>>,
    nodes: Vec<Node>,
    by_addr: HashMap<SocketAddr, usize>,
    mode: Mode,
    single: usize,
    /// Cluster: node index per slot, `u16::MAX` for none.
    slots: Vec<u16>,
    refresh_due: Option<Instant>,
    refresh_inflight: bool,
    last_refresh: Option<Instant>,
    seq: u64,
    conn_ids: u64,
    /// Queue not drained in the last turn: poll without waiting.
    more: bool,
    done: Vec<Completion>,
    replies: Vec<(Pending, Reply)>,
    scratch: Vec<u8>,
}

const NO_NODE: u16 = u16::MAX;

/// Starts a non-blocking TCP connect; true if it completed at once.
fn connect_nonblocking(addr: &SocketAddr) -> io::Result<(TcpStream, bool)> {
    // SAFETY: an all-zero sockaddr_storage is valid; the chosen variant is written in full
    // below and its size passed with it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let (family, len) = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            (libc::AF_INET, std::mem::size_of::<libc::sockaddr_in>())
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            (libc::AF_INET6, std::mem::size_of::<libc::sockaddr_in6>())
        }
    };
    // SAFETY: plain socket creation; the result is checked.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh TCP socket that nothing else owns.
    let sock = unsafe { TcpStream::from_raw_fd(fd) };
    // SAFETY: `ss` holds a valid address of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd,
            &ss as *const _ as *const libc::sockaddr,
            len as libc::socklen_t,
        )
    };
    if r == 0 {
        return Ok((sock, true));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINPROGRESS) {
        Ok((sock, false))
    } else {
        Err(e)
    }
}

impl Worker {
    fn new(
        cfg: &StoreConfig,
        seeds: &[SocketAddr],
        shared: Arc<Shared>,
        rx: mpsc::Receiver<Queued>,
        ready_tx: mpsc::Sender<()>,
    ) -> Worker {
        let now = Instant::now();
        let mut w = Worker {
            shared,
            rx,
            ready_tx: Some(ready_tx),
            timeout: cfg.timeout,
            connect_timeout: cfg.connect_timeout,
            password: cfg.password.as_ref().map(|p| p.as_bytes().to_vec()),
            ttl_ms: cfg.ttl.map(|t| t.as_millis().to_string().into_bytes()),
            nodes: Vec::new(),
            by_addr: HashMap::new(),
            mode: Mode::None,
            single: 0,
            slots: vec![NO_NODE; SLOTS],
            refresh_due: None,
            refresh_inflight: false,
            last_refresh: None,
            seq: 0,
            conn_ids: 0,
            more: false,
            done: Vec::new(),
            replies: Vec::new(),
            scratch: vec![0; 64 * 1024],
        };
        for &s in seeds {
            let i = w.node_index(s);
            let n = &mut w.nodes[i];
            n.seed = true;
            // Seeds start down and are probed at once: the probe finds out what they are.
            n.state = NodeState::Down;
            n.next_probe = now;
        }
        w
    }

    fn node_index(&mut self, addr: SocketAddr) -> usize {
        if let Some(&i) = self.by_addr.get(&addr) {
            return i;
        }
        let now = Instant::now();
        self.nodes.push(Node {
            addr,
            seed: false,
            in_map: false,
            state: NodeState::Idle,
            conn: None,
            next_probe: now,
            probe_started: now,
            ever_up: false,
            probed: false,
        });
        self.by_addr.insert(addr, self.nodes.len() - 1);
        self.nodes.len() - 1
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut owners: Vec<(usize, u64)> = Vec::new();
        loop {
            if self.shared.shutdown.load(Ordering::SeqCst) {
                return;
            }
            let now = Instant::now();
            self.maintenance(now);
            let wait = self.poll_timeout(now);
            fds.clear();
            owners.clear();
            fds.push(libc::pollfd {
                fd: self.shared.worker_fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            for (i, n) in self.nodes.iter().enumerate() {
                if let Some(c) = &n.conn {
                    let mut events = libc::POLLIN;
                    if c.connecting || c.out_pos < c.out.len() {
                        events |= libc::POLLOUT;
                    }
                    fds.push(libc::pollfd {
                        fd: c.sock.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                    owners.push((i, c.id));
                }
            }
            let ts = libc::timespec {
                tv_sec: wait.as_secs() as libc::time_t,
                tv_nsec: wait.subsec_nanos() as libc::c_long,
            };
            // SAFETY: `fds` is a live array of `fds.len()` pollfds; `ts` outlives the call.
            let r = unsafe {
                libc::ppoll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    &ts,
                    std::ptr::null(),
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    // Nothing sensible to do but avoid spinning.
                    thread::sleep(Duration::from_millis(1));
                }
                continue;
            }
            if fds[0].revents != 0 {
                // Read, then clear the flag (see `StoreHandle::clear_wake`); the queue is
                // drained after both, so an op sent before a swallowed signal is taken below.
                eventfd_clear(self.shared.worker_fd.as_raw_fd());
                self.shared.worker_notified.store(false, Ordering::SeqCst);
            }
            for (k, &(i, id)) in owners.iter().enumerate() {
                let revents = fds[k + 1].revents;
                if revents != 0 {
                    self.conn_io(i, id, revents);
                }
            }
            self.take_ops();
            self.flush_all();
            self.check_deadlines(Instant::now());
            self.deliver();
        }
    }

    fn poll_timeout(&self, now: Instant) -> Duration {
        if self.more {
            return Duration::ZERO;
        }
        let mut next = now + Duration::from_secs(1);
        for (i, n) in self.nodes.iter().enumerate() {
            match &n.conn {
                Some(c) => {
                    if let Some(d) = c.earliest() {
                        next = next.min(d);
                    }
                }
                None if n.state == NodeState::Down && self.probe_eligible(i) => {
                    next = next.min(n.next_probe)
                }
                None => {}
            }
        }
        if self.mode == Mode::Cluster && !self.refresh_inflight {
            if let Some(d) = self.refresh_due {
                next = next.min(d);
            }
        }
        next.saturating_duration_since(now)
    }

    fn probe_eligible(&self, i: usize) -> bool {
        let n = &self.nodes[i];
        match self.mode {
            Mode::None => n.seed,
            Mode::Single => i == self.single,
            Mode::Cluster => n.seed || n.in_map,
        }
    }

    /// Starts due reconnection attempts and slot-map refreshes.
    fn maintenance(&mut self, now: Instant) {
        for i in 0..self.nodes.len() {
            let n = &self.nodes[i];
            if n.state == NodeState::Down
                && n.conn.is_none()
                && now >= n.next_probe
                && self.probe_eligible(i)
            {
                self.start_probe(i, now);
            }
        }
        if self.mode == Mode::Cluster
            && !self.refresh_inflight
            && self.refresh_due.is_some_and(|d| d <= now)
        {
            let pick = (0..self.nodes.len())
                .filter(|&i| self.nodes[i].state == NodeState::Up)
                .min_by_key(|&i| match &self.nodes[i].conn {
                    Some(c) => c.connecting,
                    None => true,
                });
            if let Some(i) = pick {
                let seq = self.next_seq();
                let deadline = now + self.timeout.max(self.connect_timeout);
                let conn = self.nodes[i]
                    .conn
                    .as_mut()
                    .expect("an up node has a connection");
                encode_command(&mut conn.out, &[b"CLUSTER", b"SLOTS"]);
                conn.push(seq, deadline, What::Slots { probe: false });
                self.refresh_inflight = true;
                self.refresh_due = None;
                self.last_refresh = Some(now);
            }
        }
    }

    fn schedule_refresh(&mut self, now: Instant) {
        let at = self
            .last_refresh
            .map_or(now, |l| (l + RECONNECT_INTERVAL).max(now));
        self.refresh_due = Some(self.refresh_due.map_or(at, |d| d.min(at)));
    }

    fn new_conn(&mut self, i: usize) -> io::Result<Conn> {
        let (sock, connected) = connect_nonblocking(&self.nodes[i].addr)?;
        if connected {
            let _ = sock.set_nodelay(true);
        }
        self.conn_ids += 1;
        Ok(Conn {
            id: self.conn_ids,
            sock,
            connecting: !connected,
            probe: false,
            out: Vec::new(),
            out_pos: 0,
            inb: Vec::new(),
            in_pos: 0,
            pending: VecDeque::new(),
            mins: VecDeque::new(),
        })
    }

    fn push_auth(&mut self, conn: &mut Conn, deadline: Instant) {
        if let Some(pw) = &self.password {
            encode_command(&mut conn.out, &[b"AUTH", pw]);
            self.seq += 1;
            conn.push(self.seq, deadline, What::Auth);
        }
    }

    /// A reconnection attempt: connect, `AUTH`, `PING`, `CLUSTER SLOTS`, all within
    /// `connect_timeout`. The node comes up when the last is answered.
    fn start_probe(&mut self, i: usize, now: Instant) {
        self.nodes[i].probe_started = now;
        self.nodes[i].next_probe = now + RECONNECT_INTERVAL;
        let mut conn = match self.new_conn(i) {
            Ok(c) => c,
            Err(_) => {
                self.nodes[i].probed = true;
                self.check_ready();
                return;
            }
        };
        conn.probe = true;
        let deadline = now + self.connect_timeout;
        self.push_auth(&mut conn, deadline);
        encode_command(&mut conn.out, &[b"PING"]);
        let s = self.next_seq();
        conn.push(s, deadline, What::Ping);
        encode_command(&mut conn.out, &[b"CLUSTER", b"SLOTS"]);
        let s = self.next_seq();
        conn.push(s, deadline, What::Slots { probe: true });
        self.nodes[i].conn = Some(conn);
    }

    fn conn_is(&self, i: usize, id: u64) -> bool {
        self.nodes[i].conn.as_ref().is_some_and(|c| c.id == id)
    }

    fn conn_io(&mut self, i: usize, id: u64, revents: libc::c_short) {
        let mut replies = std::mem::take(&mut self.replies);
        let mut failure = None;
        {
            let addr = self.nodes[i].addr;
            let Some(conn) = self.nodes[i].conn.as_mut().filter(|c| c.id == id) else {
                return;
            };
            if conn.connecting && revents & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0 {
                match conn.sock.take_error() {
                    Ok(None) => {
                        conn.connecting = false;
                        let _ = conn.sock.set_nodelay(true);
                    }
                    Ok(Some(e)) | Err(e) => {
                        failure = Some(Failure::Down(format!("connect to {addr}: {e}")))
                    }
                }
            }
            if failure.is_none() && !conn.connecting {
                if revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0 {
                    match conn.read_replies(&mut self.scratch, &mut replies) {
                        Ok(false) => {}
                        Ok(true) => {
                            failure = Some(Failure::Down(format!("{addr} closed the connection")))
                        }
                        Err(Failure::Down(e)) => {
                            failure = Some(Failure::Down(format!("{addr}: {e}")))
                        }
                        Err(f) => failure = Some(f),
                    }
                }
                if failure.is_none() {
                    if let Err(e) = conn.flush() {
                        failure = Some(Failure::Down(format!("write to {addr}: {e}")));
                    }
                }
            }
        }
        for (p, r) in replies.drain(..) {
            self.on_reply(i, id, p, r);
        }
        self.replies = replies;
        if let Some(f) = failure {
            if self.conn_is(i, id) {
                self.fail_node(i, f);
            }
        }
    }

    fn on_reply(&mut self, i: usize, id: u64, p: Pending, reply: Reply) {
        let addr = self.nodes[i].addr;
        match p.what {
            What::User(op) => self.on_user_reply(i, op, reply),
            What::Asking => {}
            What::Auth | What::Ping => {
                if let Reply::Error(m) = reply {
                    if self.conn_is(i, id) {
                        self.fail_node(
                            i,
                            Failure::Down(format!("{addr} refused the connection setup: {m}")),
                        );
                    }
                }
            }
            What::Slots { probe } => {
                if !probe {
                    self.refresh_inflight = false;
                }
                if !self.conn_is(i, id) {
                    return;
                }
                self.on_slots(i, &reply);
                if probe {
                    self.probe_succeeded(i);
                }
            }
        }
    }

    fn on_slots(&mut self, i: usize, reply: &Reply) {
        match reply {
            Reply::Array(Some(items)) if !items.is_empty() => {
                if let Ok(ranges) = parse_cluster_slots(reply, self.nodes[i].addr) {
                    self.apply_slots(&ranges);
                }
            }
            _ => {
                if self.mode == Mode::None {
                    self.mode = Mode::Single;
                    self.single = i;
                    self.update_flags();
                }
            }
        }
    }

    fn apply_slots(&mut self, ranges: &[(u16, u16, SocketAddr)]) {
        let mut table = vec![NO_NODE; SLOTS];
        for &(a, b, addr) in ranges {
            let n = self.node_index(addr) as u16;
            table[a as usize..=b as usize].fill(n);
        }
        self.slots = table;
        self.mode = Mode::Cluster;
        for n in &mut self.nodes {
            n.in_map = false;
        }
        for &s in &self.slots {
            if s != NO_NODE {
                self.nodes[s as usize].in_map = true;
            }
        }
        self.update_flags();
    }

    fn probe_succeeded(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        node.probed = true;
        if self.mode == Mode::Single && i != self.single {
            // Another seed answered first; this one is not used.
            node.conn = None;
            node.state = NodeState::Idle;
        } else {
            node.state = NodeState::Up;
            if let Some(c) = node.conn.as_mut() {
                c.probe = false;
            }
            if node.ever_up {
                self.shared.c.reconnects.fetch_add(1, Ordering::Relaxed);
            }
            node.ever_up = true;
        }
        self.update_flags();
        self.check_ready();
    }

    fn check_ready(&mut self) {
        if self.ready_tx.is_some()
            && (self.mode != Mode::None || self.nodes.iter().filter(|n| n.seed).all(|n| n.probed))
        {
            let _ = self.ready_tx.take().expect("checked").send(());
        }
    }

    /// Publishes which operations fail fast in `submit`.
    fn update_flags(&self) {
        let sh = &self.shared;
        match self.mode {
            Mode::None => sh.down.store(true, Ordering::Relaxed),
            Mode::Single => sh.down.store(
                self.nodes[self.single].state == NodeState::Down,
                Ordering::Relaxed,
            ),
            Mode::Cluster => {
                let any_up = self.nodes.iter().any(|n| n.state != NodeState::Down);
                let mut degraded = false;
                for (s, &o) in self.slots.iter().enumerate() {
                    let d = if o == NO_NODE {
                        !any_up
                    } else {
                        self.nodes[o as usize].state == NodeState::Down
                    };
                    degraded |= d;
                    sh.slot_down[s].store(d, Ordering::Relaxed);
                }
                sh.down.store(degraded, Ordering::Relaxed);
            }
        }
        let mode = match self.mode {
            Mode::None => MODE_NONE,
            Mode::Single => MODE_SINGLE,
            Mode::Cluster => MODE_CLUSTER,
        };
        sh.mode.store(mode, Ordering::Release);
    }

    /// Gives up node `i`'s connection: everything in flight on it completes with the failure,
    /// and the node is marked down until a reconnection attempt succeeds.
    fn fail_node(&mut self, i: usize, f: Failure) {
        let now = Instant::now();
        let node = &mut self.nodes[i];
        let conn = node.conn.take();
        let was_probe = conn.as_ref().is_some_and(|c| c.probe);
        if node.state == NodeState::Up {
            node.ever_up = true;
        }
        node.state = NodeState::Down;
        node.next_probe = if was_probe {
            node.probe_started + RECONNECT_INTERVAL
        } else {
            now + RECONNECT_INTERVAL
        };
        if was_probe {
            node.probed = true;
        }
        if let Some(mut c) = conn {
            while let Some(p) = c.pop() {
                match p.what {
                    What::User(op) => self.complete(op.token, op.at, Err(f.error()), false),
                    What::Slots { probe: false } => self.refresh_inflight = false,
                    _ => {}
                }
            }
        }
        self.update_flags();
        if self.mode == Mode::Cluster {
            self.schedule_refresh(now);
        }
        self.check_ready();
    }

    fn on_user_reply(&mut self, i: usize, op: UserOp, reply: Reply) {
        let result = match reply {
            Reply::Error(msg) => {
                if op.redirects < MAX_REDIRECTS {
                    if let Some(r) = parse_redirect(&msg) {
                        return self.redirect(i, op, r, msg);
                    }
                }
                Err(StoreError::Server(msg))
            }
            r => match (op.cmd, r) {
                (Cmd::Set, Reply::Status(s)) if s == "OK" => Ok(None),
                (Cmd::Get, Reply::Bulk(v)) => Ok(v),
                (Cmd::Del, Reply::Int(_)) => Ok(None),
                (c, r) => Err(StoreError::Protocol(format!(
                    "unexpected reply to {c:?}: {}",
                    describe(&r)
                ))),
            },
        };
        self.complete(op.token, op.at, result, false);
    }

    fn redirect(&mut self, from: usize, mut op: UserOp, r: Redirect, msg: String) {
        let Some(addr) = resolve_node(&r.host, r.port, self.nodes[from].addr.ip()) else {
            return self.complete(op.token, op.at, Err(StoreError::Server(msg)), false);
        };
        let t = self.node_index(addr);
        self.shared.c.redirects.fetch_add(1, Ordering::Relaxed);
        if !r.ask {
            if self.mode != Mode::Cluster {
                // A single node that turns out to be a cluster node.
                let owner = if self.mode == Mode::Single {
                    self.single as u16
                } else {
                    from as u16
                };
                self.slots = vec![owner; SLOTS];
                self.nodes[owner as usize].in_map = true;
                self.mode = Mode::Cluster;
            }
            self.slots[r.slot as usize] = t as u16;
            self.nodes[t].in_map = true;
            self.update_flags();
            self.schedule_refresh(Instant::now());
        }
        op.redirects += 1;
        self.dispatch(t, op, r.ask);
    }

    fn complete(
        &mut self,
        token: u64,
        at: Instant,
        result: Result<Option<Vec<u8>>, StoreError>,
        fast: bool,
    ) {
        let latency = at.elapsed();
        self.shared.record(&result, latency, fast);
        self.done.push(Completion {
            token,
            result,
            latency,
        });
    }

    fn deliver(&mut self) {
        if self.done.is_empty() {
            return;
        }
        self.shared.done().extend(self.done.drain(..));
        self.shared.signal_completions();
    }

    fn take_ops(&mut self) {
        self.more = false;
        for _ in 0..MAX_BATCH {
            match self.rx.try_recv() {
                Ok(q) => self.accept(q),
                Err(_) => return,
            }
        }
        self.more = true;
    }

    fn accept(&mut self, q: Queued) {
        let Queued { op, at } = q;
        let (cmd, key, val) = match op.kind {
            OpKind::Set { key, val } => (Cmd::Set, key, val),
            OpKind::Get { key } => (Cmd::Get, key, Vec::new()),
            OpKind::Del { key } => (Cmd::Del, key, Vec::new()),
        };
        let op = UserOp {
            token: op.token,
            cmd,
            key,
            val,
            at,
            deadline: at + self.timeout,
            redirects: 0,
        };
        let target = match self.mode {
            Mode::None => None,
            Mode::Single => Some(self.single),
            Mode::Cluster => {
                let o = self.slots[prefixed_slot(&self.shared.prefix, &op.key) as usize];
                if o != NO_NODE {
                    Some(o as usize)
                } else {
                    // Unassigned slot: ask any live node, which redirects or refuses.
                    self.nodes.iter().position(|n| n.state == NodeState::Up)
                }
            }
        };
        match target {
            Some(t) => self.dispatch(t, op, false),
            None => {
                let e = StoreError::Down("no store node reachable".into());
                self.complete(op.token, op.at, Err(e), true);
            }
        }
    }

    /// Sends `op` to node `t` (after `ASKING` when `asking`), or completes it when it cannot go.
    fn dispatch(&mut self, t: usize, op: UserOp, asking: bool) {
        if Instant::now() >= op.deadline {
            return self.complete(op.token, op.at, Err(StoreError::Timeout), false);
        }
        match self.nodes[t].state {
            NodeState::Down => {
                let e = StoreError::Down(format!("store node {} is down", self.nodes[t].addr));
                return self.complete(op.token, op.at, Err(e), true);
            }
            NodeState::Idle => match self.new_conn(t) {
                Ok(mut conn) => {
                    self.push_auth(&mut conn, Instant::now() + self.connect_timeout);
                    let node = &mut self.nodes[t];
                    node.conn = Some(conn);
                    node.state = NodeState::Up;
                }
                Err(e) => {
                    let e = Failure::Down(format!("connect to {}: {e}", self.nodes[t].addr));
                    self.complete(op.token, op.at, Err(e.error()), false);
                    return self.fail_node(t, e);
                }
            },
            NodeState::Up => {}
        }
        let s1 = self.next_seq();
        let s2 = self.next_seq();
        let prefix = &self.shared.prefix;
        let conn = self.nodes[t]
            .conn
            .as_mut()
            .expect("an up node has a connection");
        if asking {
            encode_command(&mut conn.out, &[b"ASKING"]);
            conn.push(s1, op.deadline, What::Asking);
        }
        let out = &mut conn.out;
        match (op.cmd, &self.ttl_ms) {
            (Cmd::Set, Some(ms)) => {
                push_header(out, b'*', 5);
                push_bulk(out, &[b"SET"]);
                push_bulk(out, &[prefix, &op.key]);
                push_bulk(out, &[&op.val]);
                push_bulk(out, &[b"PX"]);
                push_bulk(out, &[ms]);
            }
            (Cmd::Set, None) => {
                push_header(out, b'*', 3);
                push_bulk(out, &[b"SET"]);
                push_bulk(out, &[prefix, &op.key]);
                push_bulk(out, &[&op.val]);
            }
            (Cmd::Get | Cmd::Del, _) => {
                push_header(out, b'*', 2);
                push_bulk(out, &[if op.cmd == Cmd::Get { b"GET" } else { b"DEL" }]);
                push_bulk(out, &[prefix, &op.key]);
            }
        }
        conn.push(s2, op.deadline, What::User(op));
    }

    fn flush_all(&mut self) {
        for i in 0..self.nodes.len() {
            let Some(c) = self.nodes[i].conn.as_mut() else {
                continue;
            };
            if c.out_pos < c.out.len() {
                if let Err(e) = c.flush() {
                    let f = Failure::Down(format!("write to {}: {e}", self.nodes[i].addr));
                    self.fail_node(i, f);
                }
            }
        }
    }

    fn check_deadlines(&mut self, now: Instant) {
        for i in 0..self.nodes.len() {
            let Some(c) = &self.nodes[i].conn else {
                continue;
            };
            if c.earliest().is_some_and(|d| d <= now) {
                let f = if c.probe {
                    Failure::Down(format!("reconnection to {} timed out", self.nodes[i].addr))
                } else {
                    Failure::Timeout
                };
                self.fail_node(i, f);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_and_slots_match_redis() {
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(
            key_slot(b"{user1000}.following"),
            key_slot(b"{user1000}.followers")
        );
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        // Empty tag: the whole key is hashed; only the first '{' counts.
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") & 16383);
        assert_eq!(key_slot(b"foo{{bar}}zap"), crc16(b"{bar") & 16383);
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        for k in [&b"abc"[..], b"x{tag}y", b"", b"{}", b"\r\n\0"] {
            let mut full = b"ub:".to_vec();
            full.extend_from_slice(k);
            assert_eq!(prefixed_slot(b"ub:", k), key_slot(&full), "{k:?}");
        }
    }

    #[test]
    fn redirects_parse() {
        let r = parse_redirect("MOVED 3999 127.0.0.1:6381").unwrap();
        assert!(!r.ask && r.slot == 3999 && r.host == "127.0.0.1" && r.port == 6381);
        let r = parse_redirect("ASK 1 ::1:7000").unwrap();
        assert!(r.ask && r.host == "::1" && r.port == 7000);
        assert!(parse_redirect("ERR wrong").is_none());
        assert!(parse_redirect("MOVED 16384 a:1").is_none());
        let asked: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(
            resolve_node("", 7000, asked),
            Some("10.0.0.1:7000".parse().unwrap())
        );
        assert_eq!(
            resolve_node("::1", 7000, asked),
            Some("[::1]:7000".parse().unwrap())
        );
    }

    #[test]
    fn config_parses_and_validates() {
        #[derive(Deserialize)]
        struct File {
            store: StoreConfig,
        }
        let f: File = toml::from_str(
            "[store]\nnodes = [\"127.0.0.1:7000\", \"[::1]:7001\"]\ntimeout = \"5ms\"\nconnect_timeout = 250\nttl = \"1.5s\"\n",
        )
        .unwrap();
        let c = f.store;
        assert_eq!(c.timeout, Duration::from_millis(5));
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.ttl, Some(Duration::from_millis(1500)));
        assert_eq!(c.key_prefix, "ub:");
        c.validate().unwrap();
        StoreConfig::default().validate().unwrap();
        assert_eq!(StoreConfig::default().timeout, Duration::from_millis(20));
        assert!(toml::from_str::<File>("[store]\nnodez = []\n").is_err());
        assert!(toml::from_str::<File>("[store]\ntimeout = \"5 parsecs\"\n").is_err());
        let err = |c: StoreConfig| c.validate().unwrap_err();
        assert!(err(StoreConfig {
            nodes: vec![],
            ..Default::default()
        })
        .contains("nodes is empty"));
        assert!(err(StoreConfig {
            nodes: vec!["localhost".into()],
            ..Default::default()
        })
        .contains("nodes[0]"));
        assert!(err(StoreConfig {
            nodes: vec!["::1:6379".into()],
            ..Default::default()
        })
        .contains("[addr]:port"));
        assert!(err(StoreConfig {
            timeout: Duration::ZERO,
            ..Default::default()
        })
        .contains("timeout is zero"));
        assert!(err(StoreConfig {
            ttl: Some(Duration::from_micros(10)),
            ..Default::default()
        })
        .contains("ttl"));
        assert!(err(StoreConfig {
            password: Some(String::new()),
            ..Default::default()
        })
        .contains("password"));
        assert!(err(StoreConfig {
            key_prefix: "{ub}:".into(),
            ..Default::default()
        })
        .contains("key_prefix"));
        let dbg = format!(
            "{:?}",
            StoreConfig {
                password: Some("hunter2".into()),
                ..Default::default()
            }
        );
        assert!(!dbg.contains("hunter2"));
    }

    #[test]
    fn handle_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<StoreHandle>();
        check::<Store>();
    }

    #[test]
    fn pending_window_minimum() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sock = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut c = Conn {
            id: 1,
            sock,
            connecting: false,
            probe: false,
            out: vec![],
            out_pos: 0,
            inb: vec![],
            in_pos: 0,
            pending: VecDeque::new(),
            mins: VecDeque::new(),
        };
        c.push(1, ms(50), What::Ping);
        c.push(2, ms(20), What::Ping);
        c.push(3, ms(30), What::Ping);
        assert_eq!(c.earliest(), Some(ms(20)));
        c.pop();
        assert_eq!(c.earliest(), Some(ms(20)));
        c.pop();
        assert_eq!(c.earliest(), Some(ms(30)));
        c.pop();
        assert_eq!(c.earliest(), None);
    }
}
