#!/usr/bin/env python3
"""Consecutive and pipelined HTTP requests on kept-alive connections (the keepalive_* tests).

usage: keepalive_client.py HOST DOCROOT

Prints one JSON object: {"results": [...]} where each result is {"conn", "what", "ok", "why",
"ms" (send to last byte), "ttfb_ms" (send, or for a pipelined response the previous one's last
byte, to first byte), "gap_ms" (longest wait between two reads of the response), "paced" (the client read this body slowly on purpose: its gaps are its
own), "retrans" (segments the client's TCP retransmitted meanwhile: tcpi_total_retrans)}. Bodies are compared with the files
in DOCROOT byte for byte. The order of requests is fixed: every run sends the same bytes.
"""
import http.client
import json
import os
import socket
import struct
import sys
import time

HOST, DOCROOT = sys.argv[1], sys.argv[2]
TIMEOUT = 20.0
results = []
files = {}


def content(name):
    if name not in files:
        with open(os.path.join(DOCROOT, name), "rb") as f:
            files[name] = f.read()
    return files[name]


def expected(name, method, rng):
    """(status, body) nginx sends for `method` /name with an optional (a, b) byte range."""
    data = content(name)
    if rng is None:
        return 200, (b"" if method == "HEAD" else data)
    a, b = rng
    b = min(b, len(data) - 1) if b is not None else len(data) - 1
    return 206, (b"" if method == "HEAD" else data[a:b + 1])


def total_retrans(sock):
    """tcpi_total_retrans of a connected socket (struct tcp_info, offset 100); 0 without one."""
    if sock is None:
        return 0
    try:
        return struct.unpack_from("I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 100)[0]
    except OSError:
        return 0


def record(conn, what, t0, ok, why="", first=None, gap=0.0, since=None, retrans=0):
    """`since`: when the client started waiting for this response's first byte (its write,
    or for a pipelined response the previous response's last byte); `t0` by default."""
    ms = lambda d: round(d * 1000, 3)  # noqa: E731
    results.append({"conn": conn, "what": what, "ms": ms(time.monotonic() - t0),
                    "ttfb_ms": ms((first if first is not None else time.monotonic()) - (since or t0)),
                    "gap_ms": ms(gap), "ok": ok, "why": why, "paced": "(slow reader)" in what,
                    "retrans": retrans})


def range_header(rng):
    a, b = rng
    return "bytes=%d-%s" % (a, "" if b is None else b)


# ---- http.client: consecutive requests on one connection -------------------------------------

def read_body(r, rate=None):
    """Reads the body in 64 KiB pieces; returns (body, longest wait for a piece). With `rate`
    (bytes/s) it reads slowly, so the response outlasts the client's retransmission timer
    (pacing, not synchronisation)."""
    out, t0 = [], time.monotonic()
    got, gap, prev = 0, 0.0, t0
    while True:
        d = r.read(64 << 10)
        now = time.monotonic()
        gap = max(gap, now - prev)
        if not d:
            return b"".join(out), gap
        out.append(d)
        got += len(d)
        if rate:
            ahead = got / rate - (now - t0)
            if ahead > 0:
                time.sleep(ahead)
        prev = time.monotonic()


def httpclient_run(conn_name, steps):
    """Steps are (method, name, range), or ("PAUSE", seconds): the client thinks between
    requests (longer than its retransmission timer). A step with a fourth element reads its
    body at 16 MiB/s (its own time is then the pacing's, flagged "paced")."""
    c = http.client.HTTPConnection(HOST, 80, timeout=TIMEOUT)
    for step in steps:
        if step[0] == "PAUSE":
            time.sleep(step[1])  # the client's think time, not synchronisation
            continue
        method, name, rng = step[:3]
        slow = len(step) > 3
        what = "%s /%s%s%s" % (method, name, "" if rng is None else " " + range_header(rng), " (slow reader)" if slow else "")
        headers = {} if rng is None else {"Range": range_header(rng)}
        t0 = time.monotonic()
        r0 = total_retrans(c.sock)
        try:
            c.request(method, "/" + name, headers=headers)
            r = c.getresponse()
            first = time.monotonic()
            body, gap = read_body(r, 16 << 20 if slow else None)
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            record(conn_name, what, t0, False, "exception: %r" % e)
            c.close()
            return
        rt = total_retrans(c.sock) - r0
        status, want = expected(name, method, rng)
        if r.status != status:
            record(conn_name, what, t0, False, "status %d, expected %d" % (r.status, status), first, gap, retrans=rt)
        elif body != want:
            record(conn_name, what, t0, False, "body of %d bytes differs (expected %d)" % (len(body), len(want)), first, gap, retrans=rt)
        else:
            record(conn_name, what, t0, True, "", first, gap, retrans=rt)
    c.close()


# ---- a raw socket: pipelined requests, and Nagle left on ---------------------------------------

class Raw:
    def __init__(self, nodelay):
        self.s = socket.create_connection((HOST, 80), timeout=TIMEOUT)
        if nodelay:
            self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.last = None  # when the last recv returned

    def fill(self):
        d = self.s.recv(1 << 20)
        if not d:
            raise EOFError("connection closed")
        self.buf += d
        now = time.monotonic()
        self.gap = max(self.gap, now - self.last) if self.first is not None else self.gap
        if self.first is None:
            self.first = now
        self.last = now

    def response(self, head_only, t0):
        """(status, body, first byte time, longest wait between two reads) of the next
        response; bytes already received count from the read that brought them (or `t0`)."""
        self.first = max(self.last, t0) if self.buf else None
        self.gap = 0.0
        self.last = self.first
        while b"\r\n\r\n" not in self.buf:
            self.fill()
        hl = self.buf.index(b"\r\n\r\n") + 4
        head = self.buf[:hl].decode("latin-1")
        status = int(head.split(" ")[1])
        n = 0
        if not head_only:
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    n = int(v)
        while len(self.buf) < hl + n:
            self.fill()
        body = self.buf[hl:hl + n]
        self.buf = self.buf[hl + n:]
        return status, body, self.first, self.gap


def req_bytes(method, name, rng):
    r = "%s /%s HTTP/1.1\r\nHost: x\r\nUser-Agent: keepalive\r\n" % (method, name)
    if rng is not None:
        r += "Range: %s\r\n" % range_header(rng)
    return (r + "\r\n").encode()


def raw_run(conn_name, batches, nodelay):
    """Each batch is sent in one write; its responses are read in order, each timed from the
    batch's write to its own last byte."""
    try:
        s = Raw(nodelay)
    except Exception as e:  # noqa: BLE001
        record(conn_name, "connect", time.monotonic(), False, "exception: %r" % e)
        return
    for batch in batches:
        t0 = time.monotonic()
        r0 = total_retrans(s.s)
        s.s.sendall(b"".join(req_bytes(*x) for x in batch))
        since = t0
        for method, name, rng in batch:
            what = "%s /%s%s" % (method, name, "" if rng is None else " " + range_header(rng))
            if len(batch) > 1:
                what += " (pipelined x%d)" % len(batch)
            try:
                st, body, first, gap = s.response(method == "HEAD", since)
            except Exception as e:  # noqa: BLE001
                record(conn_name, what, t0, False, "exception: %r" % e)
                s.s.close()
                return
            rt = total_retrans(s.s) - r0
            status, want = expected(name, method, rng)
            if st != status:
                record(conn_name, what, t0, False, "status %d, expected %d" % (st, status), first, gap, since, rt)
            elif body != want:
                record(conn_name, what, t0, False, "body of %d bytes differs (expected %d)" % (len(body), len(want)), first, gap, since, rt)
            else:
                record(conn_name, what, t0, True, "", first, gap, since, rt)
            since = s.last
    s.s.close()


G, H = "GET", "HEAD"
SEQ = [
    (G, "s1k", None),
    (G, "s1k", (100, 899)),
    (G, "m100k", None),
    (G, "m100k", (5000, 70000)),
    (H, "l10m", None),
    (G, "l10m", (1 << 20, None)),
    (G, "s1k", None),
    (G, "l10m", None),
    (G, "m100k", (0, 99)),
    (H, "s1k", None),
    (G, "s1k", None),
]

httpclient_run("http.client", SEQ)
# A response that outlasts the client's retransmission timer, then more requests; think time.
httpclient_run("http.client-slow", [
    (G, "l10m", (0, None), "slow"),
    (G, "s1k", (0, 511)),
    (G, "m100k", None),
    (G, "l10m", None, "slow"),
    (H, "l10m", None),
    ("PAUSE", 0.3),
    (G, "s1k", None),
    (G, "m100k", (1, 1000)),
])
raw_run("raw-nagle", [[x] for x in SEQ], nodelay=False)
raw_run("raw-pipelined", [
    [(G, "s1k", None), (G, "s1k", (10, 19))],
    [(G, "m100k", (0, 50000)), (H, "m100k", None), (G, "s1k", None)],
    [(G, "l10m", None), (G, "m100k", None)],
    [(G, "s1k", (1, 2)), (G, "s1k", (3, 4))],
], nodelay=True)
print(json.dumps({"results": results}))
