//! The journal server: an example recoverable application for unbroken's checkpoint mode.
//!
//! It reads fixed-size records from each peer, journals them to disk, acknowledges them to the
//! guard only once journaled (checkpointed acknowledgment, RTCP section 2.3.2), journals each
//! reply *before* sending it (section 2.3.1), and after SIGKILL — or on another host that shares
//! the journal directory and has taken over the service address — recovers every open connection
//! with the SDK (section 4) and carries on. Peers never notice.
//!
//! ```text
//! journal-server --listen 10.77.2.10:7000 --guard 10.77.2.1:7900 --key-file /etc/unbroken/app.key --dir /var/lib/journal [--fsync]
//! ```
//!
//! The key file holds the side-channel key in hex (whitespace ignored); it is not taken on the
//! command line, which any user can read with `ps`. At start-up the server checks the guard
//! ([`GuardClient::probe`]) and says on stdout what is wrong if anything is (`journal-server:
//! guard check FAILED: ...`); it still serves, and each connection it cannot protect is closed
//! the way it would be without the guard (the SDK marks it unprotected), so peers see a close,
//! never a hang. After a failed check that close comes at once (the SDK does not ask the guard)
//! and is clean ([`unbroken_sdk::decline`]: a FIN, the peer's unread input drained, no RST).
//!
//! Journal layout, one directory per connection under `DIR/conns/`:
//! `record` (the SDK's ConnRecord), `in.log` (every input byte, in order), `out.log` (every reply
//! byte, in order), `eof` (the peer finished sending), `done` (closed cleanly).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use crate::{reply, RECORD_LEN, REPLY_LEN};
use unbroken_sdk::{ConnRecord, GuardClient};

struct Args {
    listen: SocketAddr,
    guard: SocketAddr,
    key_file: PathBuf,
    dir: PathBuf,
    fsync: bool,
    echo: bool,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let (mut listen, mut guard, mut key_file, mut dir, mut fsync, mut echo) = (None, None, None, None, false, false);
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--listen" => listen = Some(val("--listen")?.parse().map_err(|e| format!("--listen: {e}"))?),
            "--guard" => guard = Some(val("--guard")?.parse().map_err(|e| format!("--guard: {e}"))?),
            "--key-file" => key_file = Some(PathBuf::from(val("--key-file")?)),
            "--key" => return Err("--key is not accepted (the command line is visible to every user): put the key in a file and pass --key-file".into()),
            "--dir" => dir = Some(PathBuf::from(val("--dir")?)),
            "--fsync" => fsync = true,
            "--echo" => echo = true,
            "-h" | "--help" => {
                println!("usage: journal-server --listen ADDR:PORT --guard ADDR:PORT --key-file PATH --dir DIR [--fsync] [--echo]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Args {
        listen: listen.ok_or("--listen is required")?,
        guard: guard.ok_or("--guard is required")?,
        key_file: key_file.ok_or("--key-file is required")?,
        dir: dir.ok_or("--dir is required")?,
        fsync,
        echo,
    })
}

fn log(msg: &str) {
    eprintln!("journal-server[{}]: {msg}", std::process::id());
}

/// One connection's durable journal.
struct Journal {
    dir: PathBuf,
    input: File,
    output: File,
    in_len: u64,
    out_len: u64,
    eof: bool,
    fsync: bool,
    /// Echo mode: the reply to every input byte is the byte itself, so the input journal is
    /// also the output journal (used to push more than 4 GiB each way through one connection).
    echo: bool,
}

impl Journal {
    fn open(dir: &Path, fsync: bool, echo: bool) -> std::io::Result<Journal> {
        fs::create_dir_all(dir)?;
        let input = OpenOptions::new().create(true).append(true).read(true).open(dir.join("in.log"))?;
        let output = OpenOptions::new().create(true).append(true).read(true).open(dir.join("out.log"))?;
        let (in_len, out_len) = (input.metadata()?.len(), output.metadata()?.len());
        // A reply is journaled whole or, after a crash mid-write, cut: drop a cut tail.
        let out_len = if echo { in_len } else { out_len - out_len % REPLY_LEN as u64 };
        if !echo {
            output.set_len(out_len)?;
        }
        Ok(Journal { dir: dir.to_path_buf(), input, output, in_len, out_len, eof: dir.join("eof").exists(), fsync, echo })
    }
    fn sync(&self, f: &File) -> std::io::Result<()> {
        if self.fsync {
            f.sync_data()?;
        }
        Ok(())
    }
    fn append_input(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.input.write_all(data)?;
        self.sync(&self.input)?;
        self.in_len += data.len() as u64;
        Ok(())
    }
    fn mark(&self, name: &str) -> std::io::Result<()> {
        File::create(self.dir.join(name))?;
        if self.fsync {
            File::open(&self.dir)?.sync_all()?;
        }
        Ok(())
    }
    /// Journals the replies to every complete record not answered yet; returns them. `fresh` is
    /// the input just journaled (echo mode answers with it).
    fn produce(&mut self, fresh: &[u8]) -> std::io::Result<Vec<u8>> {
        if self.echo {
            debug_assert_eq!(self.out_len + fresh.len() as u64, self.in_len);
            self.out_len = self.in_len;
            return Ok(fresh.to_vec());
        }
        let done = self.out_len / REPLY_LEN as u64;
        let complete = self.in_len / RECORD_LEN as u64;
        if complete <= done {
            return Ok(Vec::new());
        }
        let mut recs = vec![0u8; ((complete - done) as usize) * RECORD_LEN];
        read_at(&self.input, &mut recs, done * RECORD_LEN as u64)?;
        let mut out = Vec::with_capacity(recs.len() / RECORD_LEN * REPLY_LEN);
        for r in recs.chunks_exact(RECORD_LEN) {
            out.extend_from_slice(&reply(r));
        }
        // Output is checkpointed before it is sent (output determinism, section 2.3.1).
        self.output.write_all(&out)?;
        self.sync(&self.output)?;
        self.out_len += out.len() as u64;
        Ok(out)
    }
    fn output_from(&self, from: u64) -> std::io::Result<Vec<u8>> {
        let mut v = vec![0u8; (self.out_len - from) as usize];
        read_at(if self.echo { &self.input } else { &self.output }, &mut v, from)?;
        Ok(v)
    }
    /// Bytes of the peer's stream consumed, counting its FIN once seen (what ackA covers).
    fn consumed(&self) -> u64 {
        self.in_len + self.eof as u64
    }
}

fn read_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, off)
}

/// Fault injection for tests: when `JOURNAL_CRASH_AT` names this point, the process kills
/// itself with SIGKILL there (the way a crash would), e.g. `after-eof`, `after-shutdown`,
/// `after-fin`, `after-bytes:N` (once N input bytes are journaled), or the recovery points of
/// [`pause_point`]: `recovering`, `recovered`.
fn crash_point(name: &str) {
    if std::env::var("JOURNAL_CRASH_AT").map(|v| v == name).unwrap_or(false) {
        log(&format!("crash point {name}: SIGKILL"));
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Fault injection for tests: when `JOURNAL_PAUSE_AT` names this point, the first thread to
/// reach it prints `journal-server: paused at NAME` on stdout and stops the whole process
/// (SIGSTOP), so a test can inject another fault at that exact moment and then let the process
/// go on (SIGCONT). Points: `accepted` (a new connection accepted, not yet told to the guard),
/// `recovering` (a connection's recovery is about to start: nothing sent to the guard yet) and
/// `recovered` (its new socket is connected through the guard and
/// TELL answered; nothing resent yet).
fn pause_point(name: &str) {
    static PAUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if std::env::var("JOURNAL_PAUSE_AT").map(|v| v == name).unwrap_or(false) && !PAUSED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        println!("journal-server: paused at {name}");
        let _ = std::io::stdout().flush();
        unsafe {
            libc::raise(libc::SIGSTOP);
        }
    }
}

/// Why serving a connection stopped.
enum Stop {
    /// The connection failed under us (ECONNRESET from the guard after it restarted, section
    /// 2.7, or any socket error): recover it.
    Socket(String),
    /// The journal failed: the connection cannot be served safely.
    Fatal(String),
}

fn serve(client: &GuardClient, rec: &ConnRecord, mut stream: TcpStream, j: &mut Journal, resend_from: u64) -> Result<(), Stop> {
    fn fatal(what: &'static str) -> impl Fn(std::io::Error) -> Stop {
        move |err| Stop::Fatal(format!("{what}: {err}"))
    }
    fn sock(what: &'static str) -> impl Fn(std::io::Error) -> Stop {
        move |err| Stop::Socket(format!("{what}: {err}"))
    }
    let guard_err = |what: &'static str| move |err: unbroken_sdk::Error| Stop::Socket(format!("{what}: {err}"));
    // Finish any interrupted output, then answer records journaled but not answered yet.
    let pending = j.output_from(resend_from).map_err(fatal("reading out.log"))?;
    stream.write_all(&pending).map_err(sock("resending"))?;
    let fresh = j.produce(&[]).map_err(fatal("journal"))?;
    stream.write_all(&fresh).map_err(sock("sending"))?;
    let mut buf = vec![0u8; 64 * 1024];
    while !j.eof {
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(Stop::Socket(format!("receive: {err}"))),
        };
        if n == 0 {
            j.mark("eof").map_err(fatal("journal eof"))?;
            j.eof = true;
            unbroken_sdk::acknowledge_eof(rec, client, j.in_len).map_err(guard_err("acknowledge eof"))?;
            crash_point("after-eof");
            break;
        }
        j.append_input(&buf[..n]).map_err(fatal("journal input"))?;
        if let Some(limit) = std::env::var("JOURNAL_CRASH_AT").ok().and_then(|v| v.strip_prefix("after-bytes:").and_then(|x| x.parse::<u64>().ok())) {
            if j.in_len >= limit {
                crash_point(&format!("after-bytes:{limit}"));
            }
        }
        // Only journaled input is acknowledged to the peer.
        unbroken_sdk::acknowledge(rec, client, j.in_len).map_err(guard_err("acknowledge"))?;
        let out = j.produce(&buf[..n]).map_err(fatal("journal output"))?;
        stream.write_all(&out).map_err(sock("send"))?;
    }
    // Everything is answered: close for real (RTCP_SHUTDOWN first, so the FIN is genuine).
    unbroken_sdk::shutdown(rec, client).map_err(guard_err("shutdown"))?;
    crash_point("after-shutdown");
    stream.shutdown(std::net::Shutdown::Write).map_err(sock("shutdown"))?;
    crash_point("after-fin");
    // The peer's FIN was consumed already. The connection is done only once the peer has
    // acknowledged every byte and our FIN: until then the output sits in this kernel's send
    // queue, and a crash of the host (or of the guard, whose successor resets the orphaned
    // socket) would lose it while a "done" journal keeps the next incarnation from resending it
    // (a peer that waits forever: found by guard+app crashes on a bulk stream).
    wait_fin_acknowledged(&stream).map_err(|e| Stop::Socket(format!("closing: {e}")))?;
    j.mark("done").map_err(fatal("journal done"))?;
    Ok(())
}

/// Waits until our FIN is acknowledged (FIN-WAIT-2, TIME-WAIT, or closed without error), so
/// every byte sent before it was acknowledged too. A reset (the guard forcing a recovery) or
/// no acknowledgment within 10 minutes is an error: the connection is then recovered.
fn wait_fin_acknowledged(stream: &TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    const FIN_WAIT2: u8 = 5;
    const TIME_WAIT: u8 = 6;
    const CLOSE: u8 = 7;
    let fd = stream.as_raw_fd();
    let end = std::time::Instant::now() + std::time::Duration::from_secs(600);
    loop {
        let mut err: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: err is a c_int of len bytes.
        if unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut libc::c_int).cast(), &mut len) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if err != 0 {
            return Err(std::io::Error::from_raw_os_error(err));
        }
        let mut info = [0u8; 104];
        let mut len = info.len() as libc::socklen_t;
        // SAFETY: the kernel writes at most len bytes into info.
        if unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, info.as_mut_ptr().cast(), &mut len) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if matches!(info[0], FIN_WAIT2 | TIME_WAIT | CLOSE) {
            return Ok(());
        }
        if std::time::Instant::now() > end {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the peer never acknowledged our FIN"));
        }
        // Polling the kernel's state with a deadline: no event announces an acknowledgment.
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Most recoveries tried in a row for one connection before giving up on it.
const MAX_RECOVERIES: u32 = 50;

/// Serves a connection until it finishes, recovering it whenever its socket fails.
fn serve_recovering(client: &GuardClient, rec: &ConnRecord, dir: &Path, fsync: bool, echo: bool, first: Option<TcpStream>) -> Result<(), String> {
    let mut stream = first;
    let mut failures = 0;
    loop {
        let mut j = Journal::open(dir, fsync, echo).map_err(|e| format!("journal: {e}"))?;
        let (s, resend_from) = match stream.take() {
            Some(s) => (s, 0),
            None => match {
                crash_point("recovering");
                pause_point("recovering");
                unbroken_sdk::recover(rec, client, j.consumed(), j.out_len)
            } {
                Ok((s, delivered)) => {
                    log(&format!("{}: recovered; peer had {delivered} of {} reply bytes, input resumes at {}", rec.peer(), j.out_len, j.in_len));
                    crash_point("recovered");
                    pause_point("recovered");
                    (s, delivered)
                }
                // The peer acknowledged every byte and our FIN (one more sequence number): we
                // died after it did and before the journal said "done". Nothing is left to do.
                Err(unbroken_sdk::Error::DeliveredBeyondSent { delivered, sent }) if j.eof && delivered == sent + 1 && sent == j.out_len => {
                    log(&format!("{}: the peer had acknowledged all {sent} reply bytes and our FIN: finished", rec.peer()));
                    j.mark("done").map_err(|e| format!("journal done: {e}"))?;
                    return Ok(());
                }
                Err(e) => {
                    failures += 1;
                    if failures >= MAX_RECOVERIES {
                        return Err(format!("giving up after {failures} failed recoveries: {e}"));
                    }
                    log(&format!("{}: recovery failed ({e}), retrying", rec.peer()));
                    // Back off before the next attempt (a retry delay, not a synchronisation).
                    std::thread::sleep(std::time::Duration::from_millis(20 * failures as u64));
                    continue;
                }
            },
        };
        match serve(client, rec, s, &mut j, resend_from) {
            Ok(()) => return Ok(()),
            Err(Stop::Fatal(e)) => return Err(e),
            Err(Stop::Socket(e)) => log(&format!("{}: connection failed ({e}); recovering", rec.peer())),
        }
    }
}

/// Writes a connection's record atomically (temporary file, optional fsync, rename), so a
/// crash leaves either no record or a whole one.
fn persist_record(dir: &Path, rec: &ConnRecord, fsync: bool) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let tmp = dir.join("record.tmp");
    fs::write(&tmp, rec.to_bytes())?;
    if fsync {
        File::open(&tmp)?.sync_all()?;
    }
    fs::rename(&tmp, dir.join("record"))
}

fn conn_dir(base: &Path, peer: SocketAddr) -> PathBuf {
    base.join("conns").join(format!("{}_{}", peer.ip(), peer.port()).replace(':', "-"))
}

fn handle_new(client: Arc<GuardClient>, stream: TcpStream, peer: std::net::SocketAddr, base: PathBuf, fsync: bool, echo: bool) {
    crash_point("accepted");
    pause_point("accepted");
    let rec = match unbroken_sdk::establish(&stream, &client) {
        Ok(r) => r,
        Err(e) => {
            // At once after a failed guard check (the SDK then asks nothing). A FIN, not a RST:
            // decline reads the peer's unread input until its FIN before closing.
            log(&format!("{peer}: not protected, closing: {e}"));
            if let Err(e) = unbroken_sdk::decline(stream, std::time::Duration::from_secs(10)) {
                log(&format!("{peer}: closing: {e}"));
            }
            return;
        }
    };
    let dir = conn_dir(&base, peer);
    if let Err(e) = persist_record(&dir, &rec, fsync) {
        // Without a record the connection cannot be recovered: close it as a plain one (the
        // guard lets the FIN through once told), so the peer sees the close instead of hanging.
        let _ = unbroken_sdk::shutdown(&rec, &client);
        return log(&format!("{peer}: journal: {e}; closing"));
    }
    log(&format!("{peer}: connected and protected"));
    match serve_recovering(&client, &rec, &dir, fsync, echo, Some(stream)) {
        Ok(()) => log(&format!("{peer}: finished")),
        Err(e) => log(&format!("{peer}: {e}")),
    }
}

fn recover_one(client: Arc<GuardClient>, dir: PathBuf, fsync: bool, echo: bool) {
    let res = (|| -> Result<(), String> {
        let bytes = fs::read(dir.join("record")).map_err(|e| format!("record: {e}"))?;
        let rec = ConnRecord::from_bytes(&bytes).map_err(|e| format!("record: {e}"))?;
        serve_recovering(&client, &rec, &dir, fsync, echo, None)
    })();
    match res {
        Ok(()) => log(&format!("{}: finished after recovery", dir.display())),
        Err(e) => log(&format!("{}: {e}", dir.display())),
    }
}

/// Runs the server with command-line arguments (without the program name). Returns the exit
/// status; serves forever once listening.
pub fn main_with_args(args: impl Iterator<Item = String>) -> i32 {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("journal-server: {e}");
            return 2;
        }
    };
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = fs::metadata(&args.key_file) {
            if m.permissions().mode() & 0o077 != 0 {
                eprintln!("journal-server: warning: key file {} is readable by others (mode {:o}): anyone who reads the key can steer the guard", args.key_file.display(), m.permissions().mode() & 0o777);
            }
        }
    }
    let key = match fs::read_to_string(&args.key_file) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("journal-server: key file {}: {e}", args.key_file.display());
            return 2;
        }
    };
    let client = match GuardClient::from_strs(&args.guard.to_string(), key.trim()) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("journal-server: guard client ({}): {e}", args.key_file.display());
            return 2;
        }
    };
    // Say at once whether the guard is there and takes our key (issue 9: a wrong key or
    // address used to look like a healthy start).
    let guard_ok = match client.probe(args.listen) {
        Ok(()) => {
            println!("journal-server: guard check: ok ({} accepts our key and protects {})", args.guard, args.listen);
            true
        }
        Err(e) => {
            println!("journal-server: guard check FAILED ({}): {e}; connections will not be protected (each is closed)", args.guard);
            eprintln!("journal-server: guard check FAILED ({}): {e}", args.guard);
            false
        }
    };
    let _ = std::io::stdout().flush();
    // Recover first: every connection with a journal that did not finish.
    let mut workers = Vec::new();
    if let Ok(rd) = fs::read_dir(args.dir.join("conns")) {
        for d in rd.flatten() {
            let p = d.path();
            if p.join("record").exists() && !p.join("done").exists() {
                let c = client.clone();
                let (f, e) = (args.fsync, args.echo);
                workers.push(std::thread::spawn(move || recover_one(c, p, f, e)));
            }
        }
    }
    // Then connections the guard holds that we never told about: this process died after its
    // kernel accepted them but before it journaled their record (a crash during the handshake).
    match if guard_ok { unbroken_sdk::adopt(&client, args.listen) } else { Ok(Vec::new()) } {
        Ok(recs) => {
            for rec in recs {
                let dir = conn_dir(&args.dir, rec.peer());
                if dir.join("record").exists() {
                    continue;
                }
                if let Err(e) = persist_record(&dir, &rec, args.fsync) {
                    log(&format!("{}: cannot journal adopted connection: {e}", rec.peer()));
                    continue;
                }
                log(&format!("{}: adopted from the guard (accepted but never told)", rec.peer()));
                let c = client.clone();
                let (f, e) = (args.fsync, args.echo);
                workers.push(std::thread::spawn(move || recover_one(c, dir, f, e)));
            }
        }
        Err(e) => log(&format!("adopt: {e} (continuing without)")),
    }
    let listener = match unbroken_sdk::reuseport_listener(args.listen, 128) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("journal-server: listen {}: {e}", args.listen);
            return 1;
        }
    };
    let unprotected = if guard_ok { "" } else { " UNPROTECTED: see the guard check" };
    println!("journal-server: listening on {} ({} connection(s) recovering){unprotected}", args.listen, workers.len());
    let _ = std::io::stdout().flush();
    loop {
        // The peer's address from accept itself: a connection reset before we looked at it
        // (a guard that restarted before our TELL) has none for getpeername, and must still be
        // named to the guard so that it resets the peer (issue 21, item 4).
        match listener.accept() {
            Ok((s, peer)) => {
                let c = client.clone();
                let base = args.dir.clone();
                let (f, e) = (args.fsync, args.echo);
                std::thread::spawn(move || handle_new(c, s, peer, base, f, e));
            }
            Err(e) => log(&format!("accept: {e}")),
        }
    }
}
