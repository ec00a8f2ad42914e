#!/bin/sh
# Throughput of the pass-through consumer: iperf3 client (ns c) -> router (ns r, FORWARD queued)
# -> server (ns s). Needs root, iperf3, and a release build of the example:
#   CARGO_TARGET_DIR=/tmp/tgt-drivers cargo build --release -p unbroken-drivers --example nfq_passthrough
#   sh crates/drivers/examples/nfq_bench.sh /tmp/tgt-drivers/release/examples/nfq_passthrough [extra args]
# With `none` instead of the path it measures the same topology without a queue (the baseline).
set -eu
BIN=${1:?path to nfq_passthrough}; shift
P=nfqb$$
cleanup() {
  for f in /tmp/$P.s1.pid /tmp/$P.s2.pid; do [ -f $f ] && kill "$(cat $f)" 2>/dev/null; rm -f $f; done
  for n in c r s; do ip netns del $P$n 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM
for n in c r s; do ip netns add $P$n; ip -n $P$n link set lo up; done
ip -n ${P}c link add vc type veth peer name vrc netns ${P}r
ip -n ${P}s link add vs type veth peer name vrs netns ${P}r
ip -n ${P}c addr add 10.0.1.2/24 dev vc; ip -n ${P}c link set vc up; ip -n ${P}c route add default via 10.0.1.1
ip -n ${P}s addr add 10.0.2.2/24 dev vs; ip -n ${P}s link set vs up; ip -n ${P}s route add default via 10.0.2.1
ip -n ${P}r addr add 10.0.1.1/24 dev vrc; ip -n ${P}r addr add 10.0.2.1/24 dev vrs
ip -n ${P}r link set vrc up; ip -n ${P}r link set vrs up
ip netns exec ${P}r sysctl -qw net.ipv4.ip_forward=1
ip netns exec ${P}s iperf3 -s -1 -D -B 10.0.2.2 -p 5201 -I /tmp/$P.s1.pid
CONSUMER=
if [ "$BIN" != none ]; then
  ip netns exec ${P}r "$BIN" 0 10.0.2.2 5201 14 "$@" &
  CONSUMER=$!
  # Wait for the consumer's rules (poll, bounded).
  i=0; until ip netns exec ${P}r iptables -w -t mangle -S FORWARD | grep -q UNBROKEN-BENCH0; do
    i=$((i+1)); [ $i -lt 500 ] || { echo "consumer did not start" >&2; exit 1; }; sleep 0.01; done
fi
ip netns exec ${P}c iperf3 -c 10.0.2.2 -p 5201 -t 5 -f m | tail -4
ip netns exec ${P}s iperf3 -s -1 -D -B 10.0.2.2 -p 5201 -I /tmp/$P.s2.pid
ip netns exec ${P}c iperf3 -c 10.0.2.2 -p 5201 -t 5 -f m -R | tail -4
[ -z "$CONSUMER" ] || wait $CONSUMER
