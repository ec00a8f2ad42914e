//! The demo's unmodified peer: a plain `std::net` client with no knowledge of unbroken. It
//! streams journal records to the server, reads the replies on another thread, checks every reply
//! byte against what the server must answer, and measures the longest gap in the replies (the
//! stall a user would see). Progress and the result are JSON lines on stdout.

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use unbroken_journal::{record, reply, RECORD_LEN, REPLY_LEN};

/// Gaps in the replies at least this long are reported as they end (a `stall` line).
pub const STALL_REPORT_MS: u64 = 20;

#[derive(Debug, Clone)]
pub struct PeerArgs {
    pub connect: SocketAddr,
    pub records: u64,
    pub seed: u64,
    /// Records per second, 0 = as fast as possible.
    pub rate: u64,
    /// Give up after this long without progress.
    pub idle_timeout: Duration,
    pub progress_every: Duration,
    /// The server echoes records instead of answering them (journal server `--echo`).
    pub echo: bool,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PeerResult {
    pub ok: bool,
    pub error: Option<String>,
    pub records: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub bytes_verified: u64,
    pub sha256_received: String,
    pub sha256_expected: String,
    pub max_stall_ms: u64,
    pub duration_ms: u64,
}

/// Runs the peer; progress lines go to `progress` as they happen.
pub fn run(a: &PeerArgs, progress: &mut dyn FnMut(&serde_json::Value)) -> PeerResult {
    let start = Instant::now();
    let sent = Arc::new(AtomicU64::new(0));
    let mut res = PeerResult {
        ok: false,
        error: None,
        records: a.records,
        bytes_sent: 0,
        bytes_received: 0,
        bytes_verified: 0,
        sha256_received: String::new(),
        sha256_expected: String::new(),
        max_stall_ms: 0,
        duration_ms: 0,
    };
    let stream = match TcpStream::connect_timeout(&a.connect, Duration::from_secs(10)) {
        Ok(s) => s,
        Err(e) => {
            res.error = Some(format!("connect {}: {e}", a.connect));
            return res;
        }
    };
    let _ = stream.set_nodelay(true);
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            res.error = Some(format!("clone: {e}"));
            return res;
        }
    };
    let (records, seed, rate) = (a.records, a.seed, a.rate);
    let sent_w = sent.clone();
    let wthread = std::thread::spawn(move || -> Result<(), String> {
        let mut buf = Vec::with_capacity(64 * RECORD_LEN);
        let mut r = [0u8; RECORD_LEN];
        let t0 = Instant::now();
        let mut i = 0;
        while i < records {
            buf.clear();
            let n = (records - i).min(64);
            for k in 0..n {
                record(i + k, seed, &mut r);
                buf.extend_from_slice(&r);
            }
            if rate > 0 {
                // Pace: wait until this batch is due (pacing, not synchronisation).
                let due = Duration::from_secs_f64((i + n) as f64 / rate as f64);
                if let Some(w) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(w);
                }
            }
            writer.write_all(&buf).map_err(|e| format!("send: {e}"))?;
            i += n;
            sent_w.store(i * RECORD_LEN as u64, Ordering::Relaxed);
        }
        writer.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
        Ok(())
    });

    // Reader: verify each reply as it arrives.
    let mut reader = stream;
    let _ = reader.set_read_timeout(Some(Duration::from_millis(100)));
    let unit = if a.echo { RECORD_LEN } else { REPLY_LEN };
    let expected_total = records * unit as u64;
    let mut got = Vec::with_capacity(64 * 1024);
    let mut h_recv = Sha256::new();
    let mut h_exp = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut last_data = Instant::now();
    let mut first_data: Option<Instant> = None;
    let mut last_progress = Instant::now();
    let mut rec = [0u8; RECORD_LEN];
    let mut next_reply: u64 = 0;
    let err = loop {
        if res.bytes_received >= expected_total {
            // All replies in: the server must now close its side.
            match reader.read(&mut buf) {
                Ok(0) => break None,
                Ok(n) => {
                    res.bytes_received += n as u64;
                    break Some(format!("{n} unexpected bytes after the last reply"));
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if last_data.elapsed() > a.idle_timeout {
                        break Some("server never closed after the last reply".into());
                    }
                    continue;
                }
                Err(e) => break Some(format!("after the last reply: {e}")),
            }
        }
        match reader.read(&mut buf) {
            Ok(0) => break Some(format!("server closed early after {} of {} reply bytes", res.bytes_received, expected_total)),
            Ok(n) => {
                let now = Instant::now();
                if first_data.is_some() {
                    let gap = now.duration_since(last_data).as_millis() as u64;
                    res.max_stall_ms = res.max_stall_ms.max(gap);
                    if gap >= STALL_REPORT_MS {
                        progress(&serde_json::json!({"stall": {"ms": gap, "t_ms": start.elapsed().as_millis() as u64, "at_bytes": res.bytes_received}}));
                    }
                }
                first_data.get_or_insert(now);
                last_data = now;
                res.bytes_received += n as u64;
                h_recv.update(&buf[..n]);
                got.extend_from_slice(&buf[..n]);
                let whole = got.len() / unit * unit;
                let mut bad = None;
                for chunk in got[..whole].chunks_exact(unit) {
                    record(next_reply, seed, &mut rec);
                    let answer = reply(&rec);
                    let want: &[u8] = if a.echo { &rec } else { &answer };
                    h_exp.update(want);
                    if chunk != want {
                        bad = Some(format!("reply {next_reply} differs: got {:?}, want {:?}", String::from_utf8_lossy(chunk), String::from_utf8_lossy(want)));
                        break;
                    }
                    next_reply += 1;
                    res.bytes_verified += unit as u64;
                }
                if bad.is_some() {
                    break bad;
                }
                got.drain(..whole);
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if last_data.elapsed() > a.idle_timeout {
                    break Some(format!("no reply for {:?}", a.idle_timeout));
                }
            }
            Err(e) => break Some(format!("receive: {e}")),
        }
        if last_progress.elapsed() >= a.progress_every {
            last_progress = Instant::now();
            progress(&serde_json::json!({"progress": {
                "t_ms": start.elapsed().as_millis() as u64,
                "bytes_sent": sent.load(Ordering::Relaxed),
                "bytes_verified": res.bytes_verified,
                "max_stall_ms": res.max_stall_ms,
            }}));
        }
    };
    let werr = match wthread.join() {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(_) => Some("sender thread panicked".into()),
    };
    // In the success case the final stall includes the wait for the server's FIN: not a data stall.
    res.bytes_sent = sent.load(Ordering::Relaxed);
    res.sha256_received = hex(&h_recv.finalize());
    res.sha256_expected = hex(&h_exp.finalize());
    res.error = err.or(werr);
    res.ok = res.error.is_none() && res.bytes_verified == expected_total && res.bytes_received == expected_total && res.sha256_received == res.sha256_expected;
    res.duration_ms = start.elapsed().as_millis() as u64;
    res
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
