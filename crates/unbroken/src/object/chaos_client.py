#!/usr/bin/env python3
"""The keep-alive client of `unbroken demo object --chaos`: one http.client connection,
consecutive Range GETs that together cover /NAME in order, every body written to stdout as it
is read (so the harness hashes and times the bytes like curl's and wget's), paced to RATE
bytes/s (0: no pacing) so that faults land mid-transfer.

usage: chaos_client.py HOST NAME SIZE PARTS RATE

Exit status: 0 all parts received on the one connection, 3 the connection was replaced (http.client
reconnects silently; a kept-alive connection that broke counts as a failure), 4 a wrong status,
Content-Range or length, 5 an exception (reset, timeout, closed connection).
"""
import http.client
import sys
import time

HOST, NAME, SIZE, PARTS, RATE = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out = sys.stdout.buffer
c = http.client.HTTPConnection(HOST, 80, timeout=120)
t0 = time.monotonic()
got = 0
sock = None
step = -(-SIZE // PARTS)
try:
    for a in range(0, SIZE, step):
        b = min(a + step, SIZE) - 1
        c.request("GET", "/" + NAME, headers={"Range": "bytes=%d-%d" % (a, b)})
        if sock is None:
            sock = c.sock
        elif c.sock is not sock:
            sys.stderr.write("the kept-alive connection was replaced before bytes=%d-%d\n" % (a, b))
            sys.exit(3)
        r = c.getresponse()
        want_cr = "bytes %d-%d/%d" % (a, b, SIZE)
        if r.status != 206 or r.getheader("Content-Range") != want_cr:
            sys.stderr.write("status %d, Content-Range %r (expected 206, %r)\n" % (r.status, r.getheader("Content-Range"), want_cr))
            sys.exit(4)
        n = 0
        while True:
            d = r.read(64 << 10)
            if not d:
                break
            out.write(d)
            out.flush()
            n += len(d)
            got += len(d)
            if RATE:
                ahead = got / RATE - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)  # pacing, not synchronisation
        if n != b - a + 1:
            sys.stderr.write("part bytes=%d-%d: %d bytes\n" % (a, b, n))
            sys.exit(4)
except SystemExit:
    raise
except Exception as e:  # noqa: BLE001 - reported through the exit status
    sys.stderr.write("exception after %d bytes: %r\n" % (got, e))
    sys.exit(5)
c.close()
