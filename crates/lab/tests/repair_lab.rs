//! `unbroken_drivers::repair` against real Linux TCP in two network namespaces: a client in `a`
//! talks to a server in `b`; the server's socket is dumped, closed without a trace and rebuilt
//! from the dump with `TCP_REPAIR`, and the client, an ordinary socket, must see one unbroken
//! stream: every byte of a deterministic pattern in order, no EOF before the server's real
//! close, and no RST.
//!
//! Needs root; without it each test prints why and passes without running (fails instead with
//! UNBROKEN_REQUIRE_LAB=1).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use unbroken_lab::lab::{self, addr, Lab, PairLab};
use unbroken_drivers::repair::{self, RepairSpec};

/// Bound on every blocking read and write.
const T: Duration = Duration::from_secs(20);
const MIB: usize = 1 << 20;
const PORT: u16 = 7000;

/// One lab at a time: two cores.
static LAB: Mutex<()> = Mutex::new(());

fn lab_or_skip(name: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    if !lab::lab_or_skip(name) {
        return None;
    }
    Some(LAB.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Byte `off` of the pattern stream `seed`.
fn fill(seed: u64, off: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        let mut x = (off + i as u64) ^ seed.rotate_left(32);
        x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
        *b = (x >> 24) as u8;
    }
}

fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill(seed, off, &mut v);
    v
}

/// `TCP_INFO` of a socket: (state, bytes). getsockopt only, no side effect.
fn tcp_info(s: &TcpStream) -> (u8, Vec<u8>) {
    let mut buf = [0u8; 256];
    let mut len = buf.len() as libc::socklen_t;
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_INFO,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "TCP_INFO: {}", io::Error::last_os_error());
    (buf[0], buf[..len as usize].to_vec())
}

const TCP_ESTABLISHED: u8 = 1;

/// `tcpi_snd_wnd` (the peer's announced window, scaled, bytes; since Linux 5.4).
fn snd_wnd(s: &TcpStream) -> u32 {
    let (_, info) = tcp_info(s);
    assert!(
        info.len() >= 232,
        "TCP_INFO too short ({}) for tcpi_snd_wnd",
        info.len()
    );
    u32::from_ne_bytes(info[228..232].try_into().unwrap())
}

/// `tcpi_snd_mss`.
fn snd_mss(s: &TcpStream) -> u32 {
    let (_, info) = tcp_info(s);
    u32::from_ne_bytes(info[16..20].try_into().unwrap())
}

/// An established connection from `a` (client) to `b` (server, listener kept open).
struct Conn {
    lab: PairLab,
    _listener: TcpListener,
    server: TcpStream,
    client: TcpStream,
}

fn connect(v6: bool, client_sysctls: &[(&str, &str)]) -> Conn {
    let lab = Lab::pair().expect("pair lab");
    if !client_sysctls.is_empty() {
        lab::sysctls(&lab.a, client_sysctls).expect("client sysctls");
    }
    lab::install_rst_counter(&lab.a).expect("RST counter");
    let server_ip = if v6 {
        IpAddr::V6(addr::PAIR_B_V6)
    } else {
        IpAddr::V4(addr::PAIR_B_V4)
    };
    let to = SocketAddr::new(server_ip, PORT);
    let listener = lab::in_ns(&lab.b, || TcpListener::bind(to))
        .unwrap()
        .expect("listen");
    let client = lab::in_ns(&lab.a, || TcpStream::connect_timeout(&to, T))
        .unwrap()
        .expect("connect");
    let (server, _) = listener.accept().expect("accept");
    for s in [&client, &server] {
        s.set_read_timeout(Some(T)).unwrap();
        s.set_write_timeout(Some(T)).unwrap();
    }
    Conn {
        lab,
        _listener: listener,
        server,
        client,
    }
}

/// The client: reads `first` pattern bytes, answers one byte `k` (which carries its ACK of all
/// of them), then reads pattern bytes until EOF. Returns how many it read in all and the socket
/// (still open, so the caller decides when the client closes).
fn client_reader(
    client: TcpStream,
    seed: u64,
    first: usize,
) -> JoinHandle<Result<(u64, TcpStream), String>> {
    std::thread::spawn(move || {
        let mut c = client;
        let mut off = 0u64;
        let mut buf = vec![0u8; 256 * 1024];
        let mut want = vec![0u8; buf.len()];
        let mut answered = false;
        loop {
            let room = if !answered {
                (first as u64 - off).min(buf.len() as u64) as usize
            } else {
                buf.len()
            };
            if room == 0 {
                c.write_all(b"k")
                    .map_err(|e| format!("client write at {off}: {e}"))?;
                answered = true;
                continue;
            }
            let n = c
                .read(&mut buf[..room])
                .map_err(|e| format!("client read at {off}: {e}"))?;
            if n == 0 {
                if !answered {
                    return Err(format!("client saw EOF at {off}, before {first}"));
                }
                return Ok((off, c));
            }
            fill(seed, off, &mut want[..n]);
            if buf[..n] != want[..n] {
                let i = (0..n).find(|&i| buf[i] != want[i]).unwrap();
                return Err(format!("client: wrong byte at offset {}", off + i as u64));
            }
            off += n as u64;
        }
    })
}

/// Server side of phase 1: send `len` pattern bytes and wait for the client's `k`, so that
/// every byte is acknowledged and the receive queue is empty.
fn phase1(server: &mut TcpStream, seed: u64, len: usize) {
    server
        .write_all(&pattern(seed, 0, len))
        .expect("server phase-1 write");
    let mut k = [0u8; 1];
    server.read_exact(&mut k).expect("client's answer");
    assert_eq!(&k, b"k");
}

/// What `rebuild` must have reproduced (the dump of the rebuilt socket against the spec).
fn assert_rebuilt_like(spec: &RepairSpec, got: &RepairSpec) {
    assert_eq!(got.local, spec.local);
    assert_eq!(got.remote, spec.remote);
    assert_eq!(got.snd_nxt, spec.snd_nxt, "snd_nxt");
    assert_eq!(got.rcv_nxt, spec.rcv_nxt, "rcv_nxt");
    assert_eq!(got.mss, spec.mss, "mss");
    assert_eq!(got.snd_wscale, spec.snd_wscale, "snd_wscale");
    assert_eq!(got.rcv_wscale, spec.rcv_wscale, "rcv_wscale");
    assert_eq!(got.sack, spec.sack, "sack");
    assert_eq!(got.mark, spec.mark, "mark");
    match (spec.timestamp, got.timestamp) {
        (None, None) => {}
        (Some(a), Some(b)) => {
            let ahead = b.wrapping_sub(a) as i32;
            assert!(
                (0..10_000).contains(&ahead),
                "TSval clock {b} should continue at {a}"
            );
            assert_eq!(b & 1, 0, "millisecond TSval clock");
        }
        (a, b) => panic!("timestamps {a:?} rebuilt as {b:?}"),
    }
    assert!(
        got.rcv_wnd >= spec.rcv_wnd,
        "right edge moved left: {} < {}",
        got.rcv_wnd,
        spec.rcv_wnd
    );
}

/// One counter of `/proc/net/netstat` (e.g. `TcpExt`, `TCPWinProbe`) in namespace `ns`.
fn netstat(ns: &str, group: &str, name: &str) -> u64 {
    let out = lab::run_ok(ns, Command::new("cat").arg("/proc/net/netstat")).expect("netstat");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let prefix = format!("{group}:");
    let mut lines = text.lines().filter(|l| l.starts_with(&prefix));
    let (names, values) = (lines.next().expect(group), lines.next().expect(group));
    let i = names
        .split_whitespace()
        .position(|n| n == name)
        .expect(name);
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

/// Tests 1-3: stream 4 MiB, dump + close silently + rebuild (from the dump, changed by
/// `tweak`), stream 4 MiB more, close normally. Returns the dumped spec for option checks and
/// the time from the rebuild to the client's reading the last byte.
fn continue_stream(
    name: &str,
    v6: bool,
    client_sysctls: &[(&str, &str)],
    tweak: impl Fn(&mut RepairSpec),
) -> (RepairSpec, Duration) {
    let Conn {
        lab,
        _listener,
        mut server,
        client,
    } = connect(v6, client_sysctls);
    let seed = 0x5eed_0000 + v6 as u64;
    let half = 4 * MIB;
    let client_probe = client.try_clone().unwrap();
    let reader = client_reader(client, seed, half);

    phase1(&mut server, seed, half);
    let spec = repair::dump(&server).expect("dump");
    eprintln!("{name}: dumped {spec:?}");
    assert_eq!(spec.local, server.local_addr().unwrap());
    assert_eq!(spec.remote, server.peer_addr().unwrap());
    assert_eq!(
        snd_mss(&server),
        u32::from(spec.mss) - if spec.timestamp.is_some() { 12 } else { 0 }
    );

    repair::close_silently(server).expect("close_silently");
    assert_eq!(
        lab::rsts_seen(&lab.a).unwrap(),
        0,
        "RST after the silent close"
    );
    assert_eq!(
        tcp_info(&client_probe).0,
        TCP_ESTABLISHED,
        "the client saw the close"
    );

    let dumped = spec.clone();
    let mut spec = spec;
    tweak(&mut spec);
    let probes = netstat(&lab.b, "TcpExt", "TCPWinProbe");
    let t = Instant::now();
    let mut server = lab::in_ns(&lab.b, || repair::rebuild(&spec))
        .unwrap()
        .expect("rebuild");
    eprintln!("{name}: rebuilt in {:?}", t.elapsed());
    // Leaving repair mode with 0 sent the window probe (dump leaves with -1: no probe).
    assert_eq!(
        netstat(&lab.b, "TcpExt", "TCPWinProbe"),
        probes + 1,
        "one window probe"
    );
    server.set_read_timeout(Some(T)).unwrap();
    server.set_write_timeout(Some(T)).unwrap();
    assert!(!is_nonblocking(&server), "rebuilt socket must be blocking");
    assert_rebuilt_like(
        &spec,
        &repair::dump(&server).expect("dump of the rebuilt socket"),
    );
    assert_eq!(server.local_addr().unwrap(), spec.local);
    assert_eq!(server.peer_addr().unwrap(), spec.remote);
    // A rebuilt socket's header length comes from this namespace's tcp_timestamps sysctl (on
    // in `b`), not from the negotiation, so its cached MSS is always 12 below the clamp; the
    // kernel adds the difference back per segment when no timestamp option is sent
    // (tcp_current_mss). Without TCP_MAXSEG before connect() this would be 536 - 12.
    assert_eq!(
        snd_mss(&server),
        u32::from(spec.mss) - 12,
        "the rebuilt socket's MSS"
    );

    server
        .write_all(&pattern(seed, half as u64, half))
        .expect("server phase-2 write");
    assert_eq!(tcp_info(&client_probe).0, TCP_ESTABLISHED);
    // The right edge the client was given is never moved left (and, without window scaling,
    // the window field is not shifted by a scale the client never agreed to).
    let w = snd_wnd(&client_probe);
    assert!(
        w >= spec.rcv_wnd,
        "client's send window {w} < announced {}",
        spec.rcv_wnd
    );

    server.shutdown(Shutdown::Write).expect("server FIN");
    let (total, client) = reader
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let took = t.elapsed();
    eprintln!("{name}: client had all bytes {took:?} after the rebuild");
    assert_eq!(total, 2 * half as u64, "client read every byte once");
    drop(client);
    drop(client_probe); // the last descriptor: the client's FIN
    let mut rest = [0u8; 16];
    assert_eq!(
        server
            .read(&mut rest)
            .expect("server reads the client's FIN"),
        0
    );
    drop(server);
    assert_eq!(
        lab::rsts_seen(&lab.a).unwrap(),
        0,
        "{name}: RSTs reached the client"
    );
    (dumped, took)
}

/// Whether `O_NONBLOCK` is set on `s`.
fn is_nonblocking(s: &TcpStream) -> bool {
    let fl = unsafe { libc::fcntl(s.as_raw_fd(), libc::F_GETFL) };
    assert!(fl >= 0, "F_GETFL: {}", io::Error::last_os_error());
    fl & libc::O_NONBLOCK != 0
}

#[test]
fn rebuild_continues_stream_v4() {
    let Some(_g) = lab_or_skip("rebuild_continues_stream_v4") else {
        return;
    };
    let (spec, _) = continue_stream("v4", false, &[], |_| {});
    assert!(spec.local.is_ipv4());
    assert!(
        spec.timestamp.is_some() && spec.sack && spec.snd_wscale.is_some(),
        "{spec:?}"
    );
}

#[test]
fn rebuild_continues_stream_v4_client_without_ts_sack_wscale() {
    let Some(_g) = lab_or_skip("rebuild_continues_stream_v4_client_without_ts_sack_wscale") else {
        return;
    };
    let (spec, _) = continue_stream(
        "no-ts-sack-ws",
        false,
        &[
            ("net.ipv4.tcp_timestamps", "0"),
            ("net.ipv4.tcp_sack", "0"),
            ("net.ipv4.tcp_window_scaling", "0"),
        ],
        |_| {},
    );
    assert_eq!(
        (spec.timestamp, spec.sack, spec.snd_wscale),
        (None, false, None),
        "{spec:?}"
    );
}

#[test]
fn rebuild_continues_stream_v4_client_without_timestamps() {
    let Some(_g) = lab_or_skip("rebuild_continues_stream_v4_client_without_timestamps") else {
        return;
    };
    let (spec, _) = continue_stream("no-ts", false, &[("net.ipv4.tcp_timestamps", "0")], |_| {});
    assert_eq!(spec.timestamp, None, "{spec:?}");
    assert!(spec.sack && spec.snd_wscale.is_some(), "{spec:?}");
}

#[test]
fn rebuild_continues_stream_v6() {
    let Some(_g) = lab_or_skip("rebuild_continues_stream_v6") else {
        return;
    };
    let (spec, _) = continue_stream("v6", true, &[], |_| {});
    assert_eq!(
        spec.local,
        SocketAddr::new(IpAddr::V6(addr::PAIR_B_V6), PORT)
    );
    assert!(
        spec.timestamp.is_some() && spec.sack && spec.snd_wscale.is_some(),
        "{spec:?}"
    );
}

/// A spec whose send window is stale (0): the window probe of leaving repair mode makes the
/// client tell its real window within a round trip. (Leaving with -1 instead, the kernel's
/// zero-window probe timer recovered only after 3.1-3.3 s in this lab; the rest of the
/// transfer takes about 10 ms.)
#[test]
fn rebuild_with_a_stale_zero_window_learns_the_window_at_once() {
    let Some(_g) = lab_or_skip("rebuild_with_a_stale_zero_window_learns_the_window_at_once") else {
        return;
    };
    let (_, took) = continue_stream("zero-window", false, &[], |s| s.snd_wnd = 0);
    assert!(
        took < Duration::from_millis(1500),
        "stalled {took:?} on a stale zero window"
    );
}

/// `iptables`/`ip6tables` in `ns`: `op` is `-I` or `-D`; drops the client's packets to `b`.
fn drop_client(ns: &str, op: &str, client: SocketAddr) {
    let bin = if client.is_ipv6() {
        "ip6tables"
    } else {
        "iptables"
    };
    lab::run_ok(
        ns,
        Command::new(bin).args([
            "-w",
            op,
            "INPUT",
            "-p",
            "tcp",
            "-s",
            &client.ip().to_string(),
            "--sport",
            &client.port().to_string(),
            "-j",
            "DROP",
        ]),
    )
    .unwrap_or_else(|e| panic!("{bin} {op}: {e}"));
}

/// The client writes while no socket exists (its packets lost, as while a server host is dead);
/// its retransmission reaches the rebuilt socket, whose reader gets exactly those bytes.
#[test]
fn rebuild_receives_bytes_the_client_sent_during_the_gap() {
    let Some(_g) = lab_or_skip("rebuild_receives_bytes_the_client_sent_during_the_gap") else {
        return;
    };
    let Conn {
        lab,
        _listener,
        mut server,
        client,
    } = connect(false, &[]);
    let seed = 0x9a9;
    let first = 64 * 1024;
    let client_addr = client.local_addr().unwrap();
    let mut client_w = client.try_clone().unwrap();
    let reader = client_reader(client, seed, first);
    phase1(&mut server, seed, first);

    // The host "dies": the client's packets go nowhere from now on (a socket-less host would
    // answer them with RST, see linux-facts.md).
    drop_client(&lab.b, "-I", client_addr);
    let spec = repair::dump(&server).expect("dump");
    repair::close_silently(server).expect("close_silently");

    let request = pattern(0x4e9, 0, 100);
    client_w
        .write_all(&request)
        .expect("client writes into the gap");
    let sent = Instant::now();

    let mut server = lab::in_ns(&lab.b, || repair::rebuild(&spec))
        .unwrap()
        .expect("rebuild");
    drop_client(&lab.b, "-D", client_addr); // the host is back, with the socket
    server
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    server.set_write_timeout(Some(T)).unwrap();
    let mut got = vec![0u8; 100];
    server
        .read_exact(&mut got)
        .expect("the client's retransmission reaches the rebuilt socket");
    eprintln!(
        "gap bytes arrived {:?} after the client wrote them",
        sent.elapsed()
    );
    assert_eq!(got, request);

    server
        .write_all(&pattern(seed, first as u64, first))
        .expect("server phase-2 write");
    server.shutdown(Shutdown::Write).unwrap();
    let (total, client) = reader.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(total, 2 * first as u64);
    drop(client);
    drop(client_w);
    let mut rest = [0u8; 16];
    assert_eq!(
        server.read(&mut rest).unwrap(),
        0,
        "nothing but the client's FIN"
    );
    assert_eq!(
        lab::rsts_seen(&lab.a).unwrap(),
        0,
        "RSTs reached the client"
    );
}

#[test]
fn rebuild_errors_name_the_failed_step() {
    let Some(_g) = lab_or_skip("rebuild_errors_name_the_failed_step") else {
        return;
    };
    let Conn {
        lab,
        _listener,
        mut server,
        mut client,
    } = connect(false, &[]);
    let spec = repair::dump(&server).expect("dump");

    // A service address this host does not have.
    let mut foreign = spec.clone();
    foreign.local = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 99)), PORT);
    let e = lab::in_ns(&lab.b, || repair::rebuild(&foreign))
        .unwrap()
        .unwrap_err();
    eprintln!("foreign address: {e}");
    assert_eq!(e.kind(), io::ErrorKind::AddrNotAvailable, "{e}");
    assert!(e.to_string().starts_with("bind(10.77.0.99:7000): "), "{e}");

    // The old socket still exists in this namespace: connect() refuses the 4-tuple.
    let e = lab::in_ns(&lab.b, || repair::rebuild(&spec))
        .unwrap()
        .unwrap_err();
    eprintln!("live 4-tuple: {e}");
    assert!(
        e.to_string()
            .starts_with(&format!("connect({}): ", spec.remote)),
        "{e}"
    );

    // A window scale beyond RFC 7323's limit never reaches the kernel.
    let mut bad = spec.clone();
    bad.snd_wscale = Some(15);
    let e = lab::in_ns(&lab.b, || repair::rebuild(&bad))
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");

    // None of it disturbed the live connection, in either direction.
    server.write_all(b"still here").unwrap();
    let mut buf = [0u8; 10];
    client.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"still here");
    client.write_all(b"yes").unwrap();
    let mut buf = [0u8; 3];
    server.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"yes");
    assert_eq!(lab::rsts_seen(&lab.a).unwrap(), 0);
}
