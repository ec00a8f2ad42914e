//! An in-test guard: a UDP responder that answers side-channel commands with the real engine
//! logic (`unbroken_engines::rtcp::command` over a `Conn` per connection) after the checks a
//! guard makes (MAC, clock within 30 s, nonce not seen), plus knobs to misbehave. Packets
//! can be fed to the same `Conn`s with the real `incoming` / `outgoing` algorithms.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use unbroken_engines::rtcp::{self, Conn};
use unbroken_wire::ctl::{Command, Key, Op, Status};
use unbroken_wire::tcp::{self, Repr};
use unbroken_wire::{ip, Seq};

/// Test `test` cannot run here because `why` (a tool is missing): prints `SKIP test: why` for
/// the caller to return, or, with `UNBROKEN_REQUIRE_LAB=1` (`.ci/run` sets it), fails the test
/// with the reason. The skip rule of the SDK's tests (the SDK cannot depend on
/// unbroken-control, whose `lab::skip_or_fail` is the same rule for the crates above).
pub fn skip_or_fail(test: &str, why: &str) {
    if std::env::var("UNBROKEN_REQUIRE_LAB").is_ok_and(|v| v == "1") {
        panic!("{test} cannot run and UNBROKEN_REQUIRE_LAB=1 forbids skipping it: {why}");
    }
    // Straight to stderr, past the test harness's capture: a skip shows in every run's output
    // (scripts/test.sh counts these lines).
    let line = format!("SKIP {test}: {why} (with UNBROKEN_REQUIRE_LAB=1 this fails)\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
}

pub const KEY_HEX: &str = "00112233445566778899aabbccddeeff";
pub const WRONG_KEY_HEX: &str = "ffeeddccbbaa99887766554433221100";

pub fn key() -> Key {
    Key::from_hex(KEY_HEX).unwrap()
}

/// A datagram sent before the real answer, which the client must ignore.
#[derive(Debug, Clone, Copy)]
pub enum Decoy {
    WrongNonce,
    WrongOp,
    WrongConnection,
    NotResponse,
    WrongKey,
    Garbage,
    /// A refusal (NAK) echoing another nonce than the request's: a blind forger's.
    ForgedRefusal,
}

/// Called on each TELL before it is answered: (number of TELLs so far for this connection,
/// the connection's state).
pub type TellHook = Box<dyn FnMut(u32, &mut Conn) + Send>;

#[derive(Default)]
pub struct State {
    pub conns: HashMap<(SocketAddr, SocketAddr), Conn>,
    pub nonces: HashSet<u64>,
    /// Commands that passed all checks, in order.
    pub log: Vec<Command>,
    pub unauthenticated: u64,
    pub replayed: u64,
    pub stale: u64,
    /// Drop the next N valid requests without processing them.
    pub drop_requests: u32,
    /// Process the next N valid requests but do not send the answer.
    pub lose_replies: u32,
    /// Send these before each real answer.
    pub decoys: Vec<Decoy>,
    /// Send every real answer twice.
    pub duplicate_replies: bool,
    /// Sign answers with this key instead of the shared one (an impostor).
    pub reply_key: Option<Key>,
    pub tell_hook: Option<TellHook>,
    pub tells: HashMap<(SocketAddr, SocketAddr), u32>,
    /// Fresh ACKs for the peer built by ACKNOWLEDGE (C2).
    pub acks_built: u64,
    /// Answer a command that fails its MAC with a refusal (a NAK), as the real guard does.
    pub refuse_bad_mac: bool,
}

pub struct TestGuard {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

impl TestGuard {
    pub fn start() -> TestGuard {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        // Only so the thread notices `stop`; nothing waits on this timeout.
        sock.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let addr = sock.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || serve(sock, st, sp));
        TestGuard { addr, state, stop, thread: Some(thread) }
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    pub fn conn(&self, app: SocketAddr, peer: SocketAddr) -> Option<Conn> {
        self.state().conns.get(&(app, peer)).copied()
    }

    /// Runs algorithm I on a packet from the peer to the application.
    pub fn incoming(&self, app: SocketAddr, peer: SocketAddr, r: Repr) -> rtcp::Outcome {
        let (mut buf, len) = packet(peer, app, &r);
        let mut st = self.state();
        let c = st.conns.entry((app, peer)).or_default();
        rtcp::incoming(c, &mut buf, len).unwrap()
    }

    /// Runs algorithm O on a packet from the application to the peer.
    pub fn outgoing(&self, app: SocketAddr, peer: SocketAddr, r: Repr) -> rtcp::Outcome {
        let (mut buf, len) = packet(app, peer, &r);
        let mut st = self.state();
        let c = st.conns.entry((app, peer)).or_default();
        rtcp::outgoing(c, &mut buf, len).unwrap()
    }

    /// The guard sees a handshake where the peer connects to the application (A is the
    /// server): B's SYN (ISN `isn_b`), A's SYN-ACK (ISN `isn_a`), and, if `final_ack`, B's ACK.
    pub fn handshake(&self, app: SocketAddr, peer: SocketAddr, isn_a: u32, isn_b: u32, final_ack: bool) {
        let opts = |r: Repr| Repr { mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((1000, 0)), window: 65535, ..r };
        let syn = opts(Repr { src_port: peer.port(), dst_port: app.port(), seq: Seq(isn_b), flags: tcp::flags::SYN, ..Default::default() });
        assert!(matches!(self.incoming(app, peer, syn).verdict, unbroken_engines::Verdict::Accept { .. }));
        let synack = opts(Repr {
            src_port: app.port(),
            dst_port: peer.port(),
            seq: Seq(isn_a),
            ack: Seq(isn_b) + 1,
            flags: tcp::flags::SYN | tcp::flags::ACK,
            timestamp: Some((5000, 1000)),
            ..Default::default()
        });
        assert!(matches!(self.outgoing(app, peer, synack).verdict, unbroken_engines::Verdict::Accept { .. }));
        if final_ack {
            self.peer_ack(app, peer, isn_b.wrapping_add(1), isn_a.wrapping_add(1));
        }
    }

    /// The peer sends an empty ACK: SEQ `seq`, ACK `ack` (in its view of A's sequence space).
    pub fn peer_ack(&self, app: SocketAddr, peer: SocketAddr, seq: u32, ack: u32) {
        let r = Repr { src_port: peer.port(), dst_port: app.port(), seq: Seq(seq), ack: Seq(ack), flags: tcp::flags::ACK, window: 1000, timestamp: Some((1001, 5000)), ..Default::default() };
        assert!(matches!(self.incoming(app, peer, r).verdict, unbroken_engines::Verdict::Accept { .. }));
    }

    /// The application's TCP sends an empty ACK (SEQ `seq`, ACK `ack`, window `window`).
    pub fn app_ack(&self, app: SocketAddr, peer: SocketAddr, seq: u32, ack: u32, window: u16) -> rtcp::Outcome {
        let r = Repr { src_port: app.port(), dst_port: peer.port(), seq: Seq(seq), ack: Seq(ack), flags: tcp::flags::ACK, window, timestamp: Some((5001, 1001)), ..Default::default() };
        self.outgoing(app, peer, r)
    }

    pub fn ops(&self) -> Vec<Op> {
        self.state().log.iter().map(|c| c.op).collect()
    }
}

impl Drop for TestGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn packet(src: SocketAddr, dst: SocketAddr, r: &Repr) -> (Vec<u8>, usize) {
    let mut buf = vec![0u8; 200];
    let tl = r.header_len();
    let hl = ip::emit_header(&mut buf, src.ip(), dst.ip(), ip::PROTO_TCP, tl).unwrap();
    r.emit(&mut buf[hl..hl + tl]).unwrap();
    let pseudo = ip::pseudo_sum(src.ip(), dst.ip(), ip::PROTO_TCP, tl);
    tcp::Packet::new_checked(&mut buf[hl..hl + tl]).unwrap().fill_checksum(pseudo);
    (buf, hl + tl)
}

fn serve(sock: UdpSocket, state: Arc<Mutex<State>>, stop: Arc<AtomicBool>) {
    let key = key();
    let mut buf = [0u8; 512];
    while !stop.load(Ordering::Relaxed) {
        let (n, from) = match sock.recv_from(&mut buf) {
            Ok(x) => x,
            Err(_) => continue,
        };
        let mut st = state.lock().unwrap();
        let cmd = match Command::decode(&buf[..n], &key) {
            Ok(c) if !c.response => c,
            _ => {
                st.unauthenticated += 1;
                if st.refuse_bad_mac {
                    if let Some(nak) = unbroken_wire::ctl::Nak::refuse(&buf[..n], unbroken_wire::ctl::refusal::KEY, now_ms()) {
                        let _ = sock.send_to(&nak.encode(), from);
                    }
                }
                continue;
            }
        };
        if cmd.time_ms.abs_diff(now_ms()) > 30_000 {
            st.stale += 1;
            continue;
        }
        if !st.nonces.insert(cmd.nonce) {
            st.replayed += 1;
            continue;
        }
        if st.drop_requests > 0 {
            st.drop_requests -= 1;
            continue;
        }
        st.log.push(cmd);
        let id = (cmd.app, cmd.peer);
        // A guard forgets cleared connections (section 2.5): an all-zero state is unknown.
        let known = st.conns.get(&id).is_some_and(|c| !c.is_empty());
        let reply = if cmd.op == Op::Tell && !known {
            Command { response: true, status: Status::NoConnection as u8, flags: 0, ack_a: 0, ack_b: 0, options: None, ..cmd }
        } else {
            if cmd.op == Op::Tell {
                let count = {
                    let t = st.tells.entry(id).or_insert(0);
                    *t += 1;
                    *t
                };
                if let Some(mut hook) = st.tell_hook.take() {
                    hook(count, st.conns.get_mut(&id).unwrap());
                    st.tell_hook = Some(hook);
                }
            }
            let c = st.conns.entry(id).or_default();
            let mut ack = [0u8; 128];
            let res = rtcp::command(c, &cmd, &mut ack);
            if res.ack_len.is_some() {
                st.acks_built += 1;
            }
            res.reply
        };
        if st.lose_replies > 0 {
            st.lose_replies -= 1;
            continue;
        }
        let wrong = Key::from_hex(WRONG_KEY_HEX).unwrap();
        for d in st.decoys.clone() {
            let bytes: Vec<u8> = match d {
                Decoy::WrongNonce => Command { nonce: reply.nonce ^ 1, ..reply }.encode(&key).unwrap().to_vec(),
                Decoy::WrongOp => Command { op: if reply.op == Op::Clear { Op::Tell } else { Op::Clear }, ..reply }.encode(&key).unwrap().to_vec(),
                Decoy::WrongConnection => {
                    let mut peer = reply.peer;
                    peer.set_port(peer.port() ^ 1);
                    Command { peer, ..reply }.encode(&key).unwrap().to_vec()
                }
                Decoy::NotResponse => Command { response: false, ..reply }.encode(&key).unwrap().to_vec(),
                Decoy::WrongKey => reply.encode(&wrong).unwrap().to_vec(),
                Decoy::Garbage => vec![0x55; 40],
                Decoy::ForgedRefusal => {
                    let nak = unbroken_wire::ctl::Nak { op: reply.op as u8, refusal: unbroken_wire::ctl::refusal::KEY, nonce: reply.nonce ^ 0x5a5a, time_ms: 1 };
                    nak.encode().to_vec()
                }
            };
            let _ = sock.send_to(&bytes, from);
        }
        let k = st.reply_key.clone().unwrap_or_else(|| key.clone());
        let _ = sock.send_to(&reply.encode(&k).unwrap(), from);
        if st.duplicate_replies {
            let _ = sock.send_to(&reply.encode(&k).unwrap(), from);
        }
    }
}
