//! The key-value store as the agent uses it (issue 8 item 1): one trait, [`KvStore`], with
//! Redis behind it in production ([`RedisKv`]: the asynchronous [`StoreHandle`] for the packet
//! loop, a small pool of blocking [`Store`] clients for failover workers and probes) and an
//! in-memory map ([`MemStore`]) for unit tests and simulations. Demos and lab tests always use
//! Redis.

use crate::object::store::{Completion, Op, OpKind, Reply, Store, StoreConfig, StoreError, StoreHandle};
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Mutex;
use std::time::Duration;

/// What the agent needs from its store.
pub trait KvStore: Send + Sync {
    /// Queues an operation for the packet loop; its result comes back through
    /// [`KvStore::drain`] (also when it fails at once). False when it failed at once.
    fn submit(&self, op: Op) -> bool;
    /// Moves finished operations into `out`; returns how many.
    fn drain(&self, out: &mut Vec<Completion>) -> usize;
    /// Readable while completions are waiting (`None`: poll [`KvStore::drain`] instead).
    fn wake_fd(&self) -> Option<RawFd>;
    /// True while operations fail fast (the store is unreachable).
    fn is_down(&self) -> bool;
    /// One line for the status file.
    fn describe(&self) -> String;
    /// A blocking read (failover workers).
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Every key (without the configured prefix) that starts with `prefix` (probes of a bucket
    /// that moved here: `b<bucket>/c/`).
    fn keys_with_prefix(&self, prefix: &str) -> Result<Vec<Vec<u8>>, StoreError>;
}

/// Redis (one node or a cluster).
pub struct RedisKv {
    handle: StoreHandle,
    cfg: StoreConfig,
    /// Blocking clients kept between calls (a failover burst reuses them rather than opening a
    /// connection per connection to recover).
    pool: Mutex<Vec<Store>>,
}

/// Most idle blocking clients kept.
const POOL_MAX: usize = 8;

impl RedisKv {
    /// Starts the asynchronous client (see [`StoreHandle::start`]).
    pub fn start(cfg: &StoreConfig) -> std::io::Result<RedisKv> {
        Ok(RedisKv { handle: StoreHandle::start(cfg)?, cfg: cfg.clone(), pool: Mutex::new(Vec::new()) })
    }

    /// Runs `f` on a pooled blocking client; a client that failed is dropped, not returned.
    fn with_client<T>(&self, f: impl FnOnce(&mut Store) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let pooled = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut s = match pooled {
            Some(s) => s,
            None => Store::connect(&self.cfg)?,
        };
        let r = f(&mut s);
        if r.is_ok() {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < POOL_MAX {
                pool.push(s);
            }
        }
        r
    }
}

impl KvStore for RedisKv {
    fn submit(&self, op: Op) -> bool {
        self.handle.submit(op)
    }
    fn drain(&self, out: &mut Vec<Completion>) -> usize {
        self.handle.drain(out)
    }
    fn wake_fd(&self) -> Option<RawFd> {
        Some(self.handle.wake_fd())
    }
    fn is_down(&self) -> bool {
        self.handle.is_down()
    }
    fn describe(&self) -> String {
        format!("{:?}", self.handle.stats())
    }
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.with_client(|s| s.get(key))
    }
    fn keys_with_prefix(&self, prefix: &str) -> Result<Vec<Vec<u8>>, StoreError> {
        let pattern = format!("{}{}*", glob_escape(&self.cfg.key_prefix), glob_escape(prefix));
        let strip = self.cfg.key_prefix.len();
        self.with_client(|s| {
            let mut out = Vec::new();
            if s.is_cluster() {
                for node in s.masters() {
                    out.extend(scan_node(s, Some(node), &pattern, strip)?);
                }
            } else {
                out = scan_node(s, None, &pattern, strip)?;
            }
            Ok(out)
        })
    }
}

/// `s` as a Redis glob that matches only itself.
fn glob_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            o.push('\\');
        }
        o.push(c);
    }
    o
}

fn scan_node(store: &mut Store, node: Option<SocketAddr>, pattern: &str, strip: usize) -> Result<Vec<Vec<u8>>, StoreError> {
    let mut cursor = b"0".to_vec();
    let mut out = Vec::new();
    for _ in 0..100_000 {
        let args: [&[u8]; 6] = [b"SCAN", &cursor, b"MATCH", pattern.as_bytes(), b"COUNT", b"1000"];
        let r = match node {
            Some(n) => store.command_at(n, &args)?,
            None => store.command(&args)?,
        };
        let Reply::Array(Some(parts)) = r else { break };
        let (Some(Reply::Bulk(Some(c))), Some(Reply::Array(Some(keys)))) = (parts.first(), parts.get(1)) else { break };
        for k in keys {
            if let Reply::Bulk(Some(k)) = k {
                out.push(k[strip.min(k.len())..].to_vec());
            }
        }
        if c == b"0" {
            break;
        }
        cursor = c.clone();
    }
    Ok(out)
}

/// An in-memory store for unit tests and simulations: operations complete at once, in order,
/// unless the store is set down ([`MemStore::set_down`]: every operation then fails fast, as a
/// dead Redis does). Never used by a demo or a lab test.
#[derive(Default)]
pub struct MemStore {
    st: Mutex<MemState>,
}

#[derive(Default)]
struct MemState {
    map: BTreeMap<Vec<u8>, Vec<u8>>,
    done: VecDeque<Completion>,
    down: bool,
    ops: u64,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// Down (every operation fails) or up again.
    pub fn set_down(&self, down: bool) {
        self.lock().down = down;
    }

    /// The stored value of `key`, for checks.
    pub fn peek(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.lock().map.get(key).cloned()
    }

    /// Number of stored keys.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl KvStore for MemStore {
    fn submit(&self, op: Op) -> bool {
        let mut st = self.lock();
        st.ops += 1;
        let result = if st.down {
            Err(StoreError::Down("the in-memory store is set down".into()))
        } else {
            match op.kind {
                OpKind::Set { key, val } => {
                    st.map.insert(key, val);
                    Ok(None)
                }
                OpKind::Del { key } => {
                    st.map.remove(&key);
                    Ok(None)
                }
                OpKind::Get { key } => Ok(st.map.get(&key).cloned()),
            }
        };
        let ok = result.is_ok();
        st.done.push_back(Completion { token: op.token, result, latency: Duration::ZERO });
        ok
    }
    fn drain(&self, out: &mut Vec<Completion>) -> usize {
        let mut st = self.lock();
        let n = st.done.len();
        out.extend(st.done.drain(..));
        n
    }
    fn wake_fd(&self) -> Option<RawFd> {
        None
    }
    fn is_down(&self) -> bool {
        self.lock().down
    }
    fn describe(&self) -> String {
        let st = self.lock();
        format!("MemStore {{ keys: {}, ops: {}, down: {} }}", st.map.len(), st.ops, st.down)
    }
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let st = self.lock();
        if st.down {
            return Err(StoreError::Down("the in-memory store is set down".into()));
        }
        Ok(st.map.get(key).cloned())
    }
    fn keys_with_prefix(&self, prefix: &str) -> Result<Vec<Vec<u8>>, StoreError> {
        let st = self.lock();
        if st.down {
            return Err(StoreError::Down("the in-memory store is set down".into()));
        }
        Ok(st.map.range(prefix.as_bytes().to_vec()..).take_while(|(k, _)| k.starts_with(prefix.as_bytes())).map(|(k, _)| k.clone()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memstore_completes_in_order_and_fails_when_down() {
        let m = MemStore::new();
        assert!(m.submit(Op { token: 1, kind: OpKind::Set { key: b"b5/c/a".to_vec(), val: b"x".to_vec() } }));
        assert!(m.submit(Op { token: 2, kind: OpKind::Set { key: b"b6/c/b".to_vec(), val: b"y".to_vec() } }));
        assert!(m.submit(Op { token: 3, kind: OpKind::Get { key: b"b5/c/a".to_vec() } }));
        let mut out = vec![];
        assert_eq!(m.drain(&mut out), 3);
        assert_eq!(out.iter().map(|c| c.token).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(out[2].result, Ok(Some(b"x".to_vec())));
        assert_eq!(m.keys_with_prefix("b5/c/").unwrap(), vec![b"b5/c/a".to_vec()]);
        m.set_down(true);
        assert!(m.is_down());
        assert!(!m.submit(Op { token: 4, kind: OpKind::Del { key: b"b5/c/a".to_vec() } }));
        assert!(m.get(b"b5/c/a").is_err());
        out.clear();
        m.drain(&mut out);
        assert!(out[0].result.is_err());
        m.set_down(false);
        assert_eq!(m.get(b"b5/c/a").unwrap(), Some(b"x".to_vec()), "a failed delete deleted nothing");
    }

    #[test]
    fn glob_escape_matches_only_itself() {
        assert_eq!(glob_escape("ub:b5/c/"), "ub:b5/c/");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
