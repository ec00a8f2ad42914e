/* Checkpoint mode's fast path: RTCP's per-packet transform (seed 004, section 3.1) for the
 * established, unremarkable packets of a connection, as two tc programs beside
 * crates/engines/src/rtcp.rs, whose steps they name:
 *
 *   ckpt_outgoing  A -> B  (algorithm O: O7 checkpointed ACK, O8 SEQ - Δ, timestamps, window)
 *   ckpt_incoming  B -> A  (algorithm I: I3 ACK + Δ and SACK + Δ, timestamps, window edge)
 *
 * Each reads and updates the connection's entry in `ckpt_conns` exactly as
 * rtcp::outgoing_parsed / rtcp::incoming_parsed update Conn, and claims a packet (FP_DONE) only
 * where its answer is the engine's, byte for byte. Everything else is FP_SLOW, untouched: no
 * entry; SYN, FIN, RST (O1, O3-O6, I2, RFC 5961), a packet without ACK; a state that is not
 * synchronized (I0, O6), a recovery in progress (SYN_PENDING, ORIGIN_PINNED); an option the
 * engine would overwrite with NOPs (I1 / O2) or a malformed one; IP options, fragments, IPv6
 * extension headers; from B: a checksum that does not verify, a segment outside the window or
 * entirely below the checkpoint.
 *
 * Beside the engine's steps, the guard's own checks that the fast path must keep too: the
 * application's unprotected mark, B's ACK beyond the end of what A ever sent (RFC 5961 section
 * 5.2), the highest segment from B (the recovery nudge). The entry is read and written under its
 * spin lock (the two directions run on different CPUs); the packet is rewritten after. The
 * hand-off to and from the daemon is described in rtcp_state.h; ckpt_op is the daemon's side.
 */
#include "../common/fastpath.h"
#include "rtcp_state.h"

/* The kernel lets only programs with a GPL-compatible license string call GPL-only helpers;
 * none is called here (the project is BSD-3-Clause), but a debugging bpf_printk would be. */
char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ckpt_key);
	__type(value, struct ckpt_entry);
} ckpt_conns SEC(".maps");

/* What the programs decided, per CPU, for the daemon's status (unbroken_drivers::fastpath::
 * checkpoint::Counters). */
struct ckpt_counters {
	__u64 outgoing; /* claimed from A */
	__u64 incoming; /* claimed from B */
	__u64 slow;     /* of a connection with an entry, left to the slow path */
	__u64 dropped;  /* a rewrite the kernel could not write (FP_DROP) */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ckpt_counters);
} ckpt_stats SEC(".maps");

static __always_inline struct ckpt_counters *stats(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&ckpt_stats, &zero);
}

/* The application's "unprotected" mark (unbroken_wire::ctl::UNPROTECTED_DSCP): the guard's. */
#define CKPT_UNPROTECTED_DSCP 0x0b

/* Leaves the packet of entry `e` to the slow path: the entry freezes (see rtcp_state.h), the
 * packet is counted and marked. Called with e->lock held; releases it. */
static __always_inline int slow_locked(struct __sk_buff *skb, struct ckpt_entry *e)
{
	e->ctl |= CKPT_C_FROZEN;
	e->slow++;
	bpf_spin_unlock(&e->lock);
	skb->mark |= CKPT_MARK_SLOW;
	struct ckpt_counters *s = stats();
	if (s)
		s->slow++;
	return FP_SLOW;
}

static __always_inline int slow(struct __sk_buff *skb, struct ckpt_entry *e)
{
	bpf_spin_lock(&e->lock);
	return slow_locked(skb, e);
}

/* The end of a claimed packet: its rewrite written back, counted, marked. */
static __always_inline int done(struct __sk_buff *skb, struct fp_pkt *p, int outgoing)
{
	struct ckpt_counters *s = stats();

	if (fp_commit(skb, p)) {
		if (s)
			s->dropped++;
		return FP_DROP;
	}
	skb->mark |= CKPT_MARK_DONE;
	if (s) {
		if (outgoing)
			s->outgoing++;
		else
			s->incoming++;
	}
	return FP_DONE;
}

static __always_inline __u32 ws_shift(__u8 nibble)
{
	return nibble == RTCP_WS_NONE ? 0 : nibble;
}

/* The flags a state must have (and must not have) for either direction's fast path. */
#define CKPT_NEED RTCP_F_SYNCED
#define CKPT_REFUSE (RTCP_F_SYN_PENDING | RTCP_F_ORIGIN_PINNED)

static __always_inline int established_ack(const struct fp_pkt *p)
{
	__u8 f = ((const __u8 *)&p->th)[FP_TCP_FLAGS];

	return (f & (FP_ACK | FP_SYN | FP_FIN | FP_RST)) == FP_ACK;
}

/* Parses the packet and finds its connection's entry: `from_a` says which end *A* is (the
 * source for ckpt_outgoing, the destination for ckpt_incoming). NULL when the packet is not
 * one the programs handle, or the connection has no entry: the slow path's. */
static __always_inline struct ckpt_entry *entry_of(struct __sk_buff *skb, struct fp_pkt *p, int from_a)
{
	struct ckpt_key k = {};

	if (fp_parse(skb, FP_L3_ETH, p) || fp_forwardable(skb, FP_L3_ETH, p))
		return NULL;
	__builtin_memcpy(k.a_addr, from_a ? p->src : p->dst, 16);
	__builtin_memcpy(k.b_addr, from_a ? p->dst : p->src, 16);
	k.a_port = from_a ? p->th.source : p->th.dest;
	k.b_port = from_a ? p->th.dest : p->th.source;
	return bpf_map_lookup_elem(&ckpt_conns, &k);
}

/* Algorithm O for an established segment from A. */
SEC("classifier")
int ckpt_outgoing(struct __sk_buff *skb)
{
	struct fp_pkt p = {};
	const struct fp_opts *o = &p.o;
	struct ckpt_entry *e = entry_of(skb, &p, 1);

	if (!e)
		return FP_SLOW;

	/* O1 (RST), O3-O5 (SYN), O6 (FIN without SHUTDOWN, and the FIN's bookkeeping): slow. So is
	 * the application's unprotected mark (the guard's decision). */
	if (!established_ack(&p) || p.dscp == CKPT_UNPROTECTED_DSCP)
		return slow(skb, e);
	/* O2. Handle options: only those the engine keeps as they are. */
	if (fp_scan_options(&p))
		return slow(skb, e);

	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	__u16 win = bpf_ntohs(p.th.window);
	__u32 plen = fp_payload_len(&p);
	__u16 set = 0;

	bpf_spin_lock(&e->lock);
	if (e->ctl & CKPT_C_FROZEN)
		return slow_locked(skb, e);
	struct rtcp_conn c = e->conn;
	/* O6: no checkpoint or no Δ known (a restarted filter) resets A: slow. So does a recovery
	 * in progress (a pending SYN; a recovered socket whose origin is still pinned to ackB). */
	if ((c.flags & CKPT_NEED) != CKPT_NEED || (c.flags & CKPT_REFUSE))
		return slow_locked(skb, e);
	if (!(c.flags & (RTCP_F_ACK_ALLOWED | RTCP_F_ACK_EVERYTHING)))
		return slow_locked(skb, e);

	/* O7. Checkpoint ACK, never above what A's TCP acknowledges itself; the `held` bytes A's
	 * TCP has but the application has not checkpointed stay unacknowledged. */
	__u32 held = 0;
	if (!(c.flags & RTCP_F_ACK_EVERYTHING) && seq_lt(c.ack_a, ack)) {
		held = ack - c.ack_a;
		fp_set32(&p, FP_TCP_ACK, ack, c.ack_a);
	}
	/* O8. Fix SEQ. */
	__u32 seq_b = seq - c.delta;
	if (c.delta)
		fp_set32(&p, FP_TCP_SEQ, seq, seq_b);
	/* The end of what the current socket sent (Conn::a_end). */
	__u32 end = seq_b + plen;
	if (seq_gt(end, c.a_end))
		c.a_end = end;
	/* Timestamps: keep what B sees monotonic across sockets. */
	if (o->ts_at) {
		__u32 v = o->tsval + c.ts_off;
		if (c.ts_off)
			fp_set32(&p, o->ts_at + 2, o->tsval, v);
		if (!(c.flags & RTCP_F_TS_A_KNOWN) || seq_gt(v, c.ts_a)) {
			c.ts_a = v;
			set |= RTCP_F_TS_A_KNOWN;
		}
	}
	/* Window: keep the right edge B sees where A's TCP put it (the ACK was lowered by `held`
	 * bytes), in the scale B applies if the new socket's differs. */
	__u8 cur = c.ws_cur & 0x0f, old = c.ws >> 4;
	__u16 w2 = win;
	if (cur != old || held) {
		__u64 w = (((__u64)win << ws_shift(cur)) + held) >> ws_shift(old);
		w2 = w > 0xffff ? 0xffff : (__u16)w;
	}
	if (w2 != win)
		fp_set16(&p, FP_TCP_WINDOW, win, w2);
	c.a_win = w2;
	set |= RTCP_F_A_WIN_KNOWN;

	/* O9. The state as the engine leaves it, and the guard's end of what A ever sent (it
	 * knows one only if it saw the handshake). The rewrite is written after the lock: a
	 * packet the kernel then fails to write is dropped (TCP resends it) with the state
	 * already advanced, which only ever records what A sent or what B saw of A. */
	e->conn.a_end = c.a_end;
	e->conn.ts_a = c.ts_a;
	e->conn.a_win = c.a_win;
	e->conn.flags |= set;
	if ((e->ctl & CKPT_C_A_HI) && seq_gt(end, e->a_hi))
		e->a_hi = end;
	bpf_spin_unlock(&e->lock);
	return done(skb, &p, 1);
}

/* A peer's segment verifies: the NIC checked it (CHECKSUM_UNNECESSARY), or the sum over the
 * pseudo-header and the segment is right, or it was built on this host (a namespace, a VM on a
 * veth or tap) and handed over before its checksum was completed (CHECKSUM_PARTIAL: the field
 * holds the pseudo-header's sum, which the engine's slow path accepts as NFQUEUE's
 * csum_not_ready). A tc program cannot read ip_summed, so the last case is recognized by that
 * value: a packet from the wire whose field holds exactly it is accepted unverified, which only
 * one who forges packets can arrange, and who can as well compute a right checksum
 * (docs/threat-model.md, "Fast path"). */
static __always_inline int peer_csum_ok(struct __sk_buff *skb, const struct fp_pkt *p)
{
	if (bpf_csum_level(skb, BPF_CSUM_LEVEL_QUERY) >= 0)
		return 1;
	if (fp_l4_csum_partial(p))
		return 1;
	return fp_l4_csum_ok(skb, p);
}

/* Algorithm I for an established segment from B. */
SEC("classifier")
int ckpt_incoming(struct __sk_buff *skb)
{
	struct fp_pkt p = {};
	const struct fp_opts *o = &p.o;
	struct ckpt_entry *e = entry_of(skb, &p, 0);

	if (!e)
		return FP_SLOW;

	/* SYN (I2, section 6, RFC 5961 challenges), RST (RFC 5961), FIN (its bookkeeping): slow. */
	if (!established_ack(&p))
		return slow(skb, e);
	/* Every packet from B may be forged: it must verify (issue 9, item 2). A packet that does
	 * not is the engine's to drop and count. */
	if (!peer_csum_ok(skb, &p))
		return slow(skb, e);
	/* I1. Handle options. */
	if (fp_scan_options(&p))
		return slow(skb, e);

	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	__u32 len = fp_payload_len(&p);
	__u16 set = 0;

	bpf_spin_lock(&e->lock);
	if (e->ctl & CKPT_C_FROZEN)
		return slow_locked(skb, e);
	struct rtcp_conn c = e->conn;
	/* I0: a state that cannot translate B's ACK: slow. So is a recovery in progress. */
	if ((c.flags & CKPT_NEED) != CKPT_NEED || (c.flags & CKPT_REFUSE))
		return slow_locked(skb, e);
	/* The guard's RFC 5961 section 5.2: B cannot acknowledge what A never sent (the guard
	 * drops and counts it). */
	if ((e->ctl & CKPT_C_A_HI) && seq_gt(ack, e->a_hi))
		return slow_locked(skb, e);

	/* Where the segment lies: only one the engine learns from (in the window *A*'s TCP could
	 * accept) is claimed; one beyond it (dropped) or entirely below the checkpoint (forwarded
	 * unlearned) is the slow path's. */
	if ((c.flags & RTCP_F_ACK_ALLOWED) && !(c.flags & RTCP_F_ACK_EVERYTHING)) {
		__u32 s = !(c.flags & RTCP_F_OPTS_KNOWN) ? 14 : ws_shift(c.ws >> 4);
		__u32 span = 0xffffu << s;
		if (seq_ge(seq, c.ack_a)) {
			if (seq - c.ack_a > span)
				return slow_locked(skb, e);
		} else if (!seq_gt(seq + len, c.ack_a)) {
			return slow_locked(skb, e);
		}
	}

	/* Timestamps: remember B's clock and what B has seen of A's; TSecr back into A's clock. */
	if (o->ts_at) {
		if (!(c.flags & RTCP_F_TS_B_KNOWN) || seq_gt(o->tsval, c.ts_b)) {
			c.ts_b = o->tsval;
			set |= RTCP_F_TS_B_KNOWN;
		}
		if (o->tsecr && (!(c.flags & RTCP_F_TS_A_KNOWN) || seq_gt(o->tsecr, c.ts_a))) {
			c.ts_a = o->tsecr;
			set |= RTCP_F_TS_A_KNOWN;
		}
		if (c.ts_off && o->tsecr)
			fp_set32(&p, o->ts_at + 6, o->tsecr, o->tsecr - c.ts_off);
	}
	/* ackB: B's latest acknowledgment. */
	if (!(c.flags & RTCP_F_RECOVERABLE) || seq_ge(ack, c.ack_b))
		c.ack_b = ack;
	set |= RTCP_F_RECOVERABLE;

	/* I3. Handle acknowledgment: ACK + Δ, and the SACK edges with it. The ACK never covers
	 * more than A's current socket sent (Conn::a_end). */
	__u32 fwd = ack;
	if ((c.flags & RTCP_F_A_WIN_KNOWN) && seq_gt(ack, c.a_end))
		fwd = c.a_end;
	if (c.delta || fwd != ack)
		fp_set32(&p, FP_TCP_ACK, ack, fwd + c.delta);
	if (c.delta && o->sack_at) {
		for (__u32 i = 0; i < 8; i++) {
			if (i >= o->sack_n * 2)
				break;
			__u32 at = o->sack_at + 2 + 4 * i;
			__u32 edge = fp_opt32(&p, at - sizeof(struct tcphdr));
			fp_set32(&p, at, edge, edge + c.delta);
		}
	}
	/* B's pure ACK carries B's SND.NXT as its SEQ: one beyond the right edge B last saw from
	 * A is lowered to that edge, which A's TCP accepts. */
	__u16 need = RTCP_F_A_WIN_KNOWN | RTCP_F_ACK_ALLOWED;
	if (!len && (c.flags & need) == need && !(c.flags & RTCP_F_ACK_EVERYTHING)) {
		__u32 edge = c.ack_a + ((__u32)c.a_win << ws_shift(c.ws >> 4));
		if (seq_gt(seq, edge))
			fp_set32(&p, FP_TCP_SEQ, seq, edge);
	}

	/* I4. The state as the engine leaves it, and the guard's highest segment from B (for its
	 * recovery nudge; a pure ACK stands for a last segment of an MSS ending at its SEQ). */
	e->conn.ts_b = c.ts_b;
	e->conn.ts_a = c.ts_a;
	e->conn.ack_b = c.ack_b;
	e->conn.flags |= set;
	__u32 mss = c.b_mss ? c.b_mss : 1460;
	if (mss < 536)
		mss = 536;
	__u32 lo = len ? seq : seq - mss, hi = seq + len;
	if (!(e->ctl & CKPT_C_PEER) || seq_gt(hi, e->peer_hi)) {
		e->peer_lo = lo;
		e->peer_hi = hi;
		e->ctl |= CKPT_C_PEER;
	}
	bpf_spin_unlock(&e->lock);
	return done(skb, &p, 0);
}

/* The daemon's operations on an entry (see rtcp_state.h), run through BPF_PROG_TEST_RUN: the
 * request after a 14-byte Ethernet header, the answer written over it. Never attached. */
SEC("classifier")
int ckpt_op(struct __sk_buff *skb)
{
	struct ckpt_op_req rq = {};
	struct ckpt_op_ans an = {};

	if (bpf_skb_load_bytes(skb, FP_L3_ETH, &rq, sizeof(rq)))
		return 3;
	an.key = rq.key;
	struct ckpt_entry *e = bpf_map_lookup_elem(&ckpt_conns, &rq.key);
	if (!e) {
		an.result = 1;
		goto out;
	}
	bpf_spin_lock(&e->lock);
	an.ctl_before = e->ctl;
	switch (rq.op) {
	case CKPT_OP_TAKE:
		/* Never beyond what was counted: a counted packet taken after THAW_FORCE gave up
		 * on it would otherwise open a gap no later packet closes. */
		if (e->seen != e->slow)
			e->seen++;
		/* fall through */
	case CKPT_OP_FREEZE:
		e->ctl |= CKPT_C_FROZEN | CKPT_C_USER;
		break;
	case CKPT_OP_THAW:
		if (e->seen != e->slow) {
			an.result = 2;
			break;
		}
		/* fall through */
	case CKPT_OP_THAW_FORCE:
		e->seen = e->slow;
		e->ctl = rq.value.ctl & (CKPT_C_A_HI | CKPT_C_PEER);
		e->a_hi = rq.value.a_hi;
		e->peer_lo = rq.value.peer_lo;
		e->peer_hi = rq.value.peer_hi;
		e->conn = rq.value.conn;
		break;
	case CKPT_OP_ACK: {
		struct rtcp_conn c = e->conn;
		__u16 need = RTCP_F_ACK_ALLOWED | RTCP_F_OPTS_KNOWN;
		if ((e->ctl & CKPT_C_FROZEN) || (c.flags & need) != need) {
			an.result = 4;
			break;
		}
		__u32 ack = rq.value.conn.ack_a;
		if (seq_ge(ack, c.ack_a)) {
			/* The right edge B sees stays where A's TCP last put it: the window shrinks
			 * by as much as the checkpoint advances. */
			if (c.flags & RTCP_F_A_WIN_KNOWN) {
				__u32 s = ws_shift(c.ws >> 4);
				__u64 win = (__u64)c.a_win << s;
				__u64 adv = ack - c.ack_a;
				__u64 left = win > adv ? win - adv : 0;
				left >>= s;
				e->conn.a_win = left > 0xffff ? 0xffff : (__u16)left;
			}
			e->conn.ack_a = ack;
		}
		break;
	}
	default:
		an.result = 3;
	}
	an.value.ctl = e->ctl;
	an.value.slow = e->slow;
	an.value.seen = e->seen;
	an.value.a_hi = e->a_hi;
	an.value.peer_lo = e->peer_lo;
	an.value.peer_hi = e->peer_hi;
	an.value.conn = e->conn;
	bpf_spin_unlock(&e->lock);
out:
	if (bpf_skb_store_bytes(skb, FP_L3_ETH, &an, sizeof(an), 0))
		return 3;
	return an.result;
}
