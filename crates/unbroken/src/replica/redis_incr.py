#!/usr/bin/env python3
"""The redis-py client of `unbroken demo replica` and the replica namespace tests: ONE
connection (redis-py, single_connection_client, no retry), N INCRs on its own key, every reply
checked against the count it must be (the key starts absent). Paced to RATE ops/s (0: no
pacing) so that faults land mid-run.

usage: redis_incr.py HOST PORT KEY N RATE

stdout: `progress I` after every 100th op (the harness times its faults on these), then one
JSON line: ok, ops (INCRs answered correctly), last (the last reply), error (text or null),
reconnects (times the client's socket was replaced), port_start, port_end (the client's local
port), max_gap_ms (longest time one INCR took: the stall the application saw).
Exit status: 0 all N replies exact on the one connection, 3 the connection was replaced,
4 a wrong reply, 5 an exception (reset, timeout, closed connection).
"""
import json
import sys
import time

import redis

HOST, PORT, KEY, N, RATE = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
res = {"ok": False, "ops": 0, "last": None, "error": None, "reconnects": 0,
       "port_start": None, "port_end": None, "max_gap_ms": 0}
code = 0
r = redis.Redis(host=HOST, port=PORT, socket_timeout=60, socket_connect_timeout=10,
                single_connection_client=True, retry_on_timeout=False, health_check_interval=0)
t0 = time.monotonic()
try:
    r.ping()
    conn = r.connection
    sock = conn._sock
    res["port_start"] = sock.getsockname()[1]
    for i in range(1, N + 1):
        t = time.monotonic()
        v = r.incr(KEY)
        gap = int((time.monotonic() - t) * 1000)
        if gap > res["max_gap_ms"]:
            res["max_gap_ms"] = gap
        if conn._sock is not sock:
            res["reconnects"] += 1
            sock = conn._sock
            code = 3
        res["last"] = v
        if v != i:
            res["error"] = "INCR %d answered %r" % (i, v)
            code = 4
            break
        res["ops"] = i
        if i % 100 == 0:
            print("progress %d" % i, flush=True)
        if RATE > 0:
            ahead = t0 + i / RATE - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    if conn._sock is not None:
        res["port_end"] = conn._sock.getsockname()[1]
except Exception as e:  # a reset, a timeout, a closed connection: the client saw a failure
    res["error"] = "%s: %s" % (type(e).__name__, e)
    code = 5
res["ok"] = code == 0 and res["ops"] == N
print(json.dumps(res), flush=True)
sys.exit(code)
