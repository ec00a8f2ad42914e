#!/usr/bin/env python3
"""Recovery stalls after application crashes, per connection (docs/benchmarks.md, "Recovery after
an application restart"). Runs `unbroken demo checkpoint --json` TRIALS times (seeds 1..TRIALS)
and, for each crash and each connection, takes the longest gap in that connection's replies that
ended before the next crash (0 when none reached 20 ms).

usage: sudo scripts/recovery_stalls.py TRIALS CONNECTIONS RATE RECORDS CRASHES [demo options...]
e.g.   sudo scripts/recovery_stalls.py 4 8 0 150000 app,app,app --nudge
"""
import json, os, subprocess, sys
trials,conns,rate,records,crashes=int(sys.argv[1]),int(sys.argv[2]),sys.argv[3],sys.argv[4],sys.argv[5]
extra=sys.argv[6:]
rec=[]; tcp={}; fails=0
for t in range(trials):
    out=subprocess.run([os.environ.get('UNBROKEN', os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'target', 'release', 'unbroken')),'demo','checkpoint','--json','--connections',str(conns),'--rate',rate,'--records',records,'--crashes',crashes,'--seed',str(t+1)]+extra,capture_output=True,text=True).stdout
    try: r=json.loads(out.strip().splitlines()[-1])
    except Exception as e: print('bad',out[-300:]); fails+=1; continue
    if not r['ok']: print('not ok',r['error']); fails+=1
    crashes_t=[c['t_ms'] for c in r['crash_log']]
    for i,ct in enumerate(crashes_t):
        nxt=crashes_t[i+1] if i+1<len(crashes_t) else 10**9
        for c in range(conns):
            s=[st['ms'] for st in r['stalls'] if st['conn']==c and ct<=st['end_t_ms']<min(nxt,ct+2000)]
            rec.append(max(s) if s else 0)
    for k,v in r['peer_tcp'].items():
        if k in ('TCPTimeouts','TCPLossProbes','TCPSackRecovery','TCPSACKReneging','RetransSegs'): tcp[k]=tcp.get(k,0)+v
rec.sort()
n=len(rec)
def pct(p): return rec[min(n-1,int(p*n))]
print(f"conns={conns} rate={rate} crashes={crashes} trials={trials} extra={extra} failures={fails}")
print(f"recoveries={n} under20ms={sum(1 for x in rec if x<20)} 20-59={sum(1 for x in rec if 20<=x<60)} 60+={sum(1 for x in rec if x>=60)} p50={pct(.5)} p90={pct(.9)} p99={pct(.99)} max={rec[-1]}")
print("peer tcp", tcp)
