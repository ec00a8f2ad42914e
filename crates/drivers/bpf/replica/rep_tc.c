/* Replica mode's fast path, the backup's half (issue 22 item 4, step 1): the per-packet steps of
 * unbroken_engines::replica::Backup for the steady state of an aligned connection, as two tc
 * programs that name the engine's steps (ST-TCP seed 001 3.3.0.1 / 3.3.1, Koch seed 003 3.1):
 *
 *   rep_b_in   client -> backup server  (Backup::incoming: the client's ACK, SACK edges - Δ,
 *              clamped to what the backup's server sent, TSecr - offset; what it learns from an
 *              acceptable segment: last_ack, acked_b, ts_floor, client_ts_max, client_ts)
 *   rep_b_out  backup server -> client  (Backup::outgoing before take-over: withheld; what it
 *              learns: SND.MAX, RCV.NXT and the window edge, the server's newest TSval, the
 *              output digest (learn_output: FNV-1a over the bytes, GSO super-packets whole,
 *              with strict output commit only; without it only the output end moves),
 *              its checkpoint and the copy kept for the take-over, both sent to the daemon as
 *              ring-buffer records)
 *
 * Claimed only where the answer is the engine's: everything else is FP_SLOW, untouched, the
 * entry frozen (rep_state.h): no entry (not aligned, or promoted: the daemon removes every entry
 * at take-over); SYN, FIN, RST, no ACK; IP options, fragments, IPv6 extension headers; an option
 * the engine would not parse, or at an odd offset; from the client, a checksum that does not
 * verify; from the server, output beyond a gap in the digest (BConn::ooo). rep_op is the
 * daemon's side of the hand-off.
 */
#include "../common/fastpath.h"
#include "rep_state.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* A withheld packet of the backup's server, or one copied to the daemon: claimed and consumed
 * (TC_ACT_STOLEN: attached at egress as a cls_bpf filter in direct-action mode, freed and
 * reported sent to its TCP; TCX would take STOLEN for "next" and pass it). */
#define FP_CONSUMED TC_ACT_STOLEN
/* A client segment the engine drops by decision (an ACK beyond what the backup's server sent,
 * in strict mode), at TCX ingress: dropped (TCX honours SHOT, not STOLEN). */
#define FP_DROPPED_IN TC_ACT_SHOT

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct rep_key);
	__type(value, struct rep_b_entry);
} rep_b_conns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 << 20);
} rep_records SEC(".maps");

/* The engine's BackupCounters the programs move, and their own, per CPU
 * (unbroken_drivers::fastpath::replica::Counters). */
struct rep_counters {
	__u64 incoming;       /* claimed client packets */
	__u64 withheld;       /* claimed server packets (BackupCounters::withheld) */
	__u64 slow;           /* of a connection with an entry, left to the slow path */
	__u64 dropped;        /* a rewrite the kernel could not write */
	__u64 unacceptable;   /* BackupCounters::unacceptable */
	__u64 ack_unverified; /* BackupCounters::ack_unverified */
	__u64 ack_clamped;    /* BackupCounters::ack_clamped */
	__u64 dropped_beyond; /* client segments dropped: ACK beyond, strict */
	__u64 records_lost;   /* ring-buffer records that did not fit */
	__u64 unparsed_dropped; /* egress, copy mode: unparsable TCP from a service address */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rep_counters);
} rep_stats SEC(".maps");

struct rep_piece {
	struct rep_rec h;
	__u8 buf[REP_KEEP_PIECE];
	/* This CPU's packets copied in pieces so far: every piece names its packet by (CPU, this
	 * number), so that the daemon never joins pieces of two packets (two CPUs' pieces
	 * interleave in the ring; one packet's are consecutive, a program runs on one CPU). */
	__u32 next_id;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rep_piece);
} rep_piece_buf SEC(".maps");

/* learn_output's checkpoints inside a segment (CHECKPOINT_STEP): the ones its bytes cross before
 * their end, kept while it is hashed and recorded once its entry is committed. The position
 * lives here, not in the loop's context: the verifier does not follow map contents, so a test
 * of it does not make every bpf_loop step a new state to verify. */
#define REP_CP_STEP 1024
#define REP_CP_MAX (65536 / REP_CP_STEP + 1)
struct rep_cps {
	__u32 n;
	__u32 pos;   /* the next byte's sequence number, primary's space */
	__u32 start; /* pos at the first step */
	__u32 pad;
	__u32 end[REP_CP_MAX];
	__u64 hash[REP_CP_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rep_cps);
} rep_cp_buf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rep_cfg);
} rep_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, struct rep_svc);
	__type(value, __u8);
} rep_services SEC(".maps");

static __always_inline struct rep_counters *stats(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&rep_stats, &zero);
}

#define COUNT(field)                              \
	({                                        \
		struct rep_counters *__s = stats(); \
		if (__s)                          \
			__s->field++;             \
	})

static __always_inline int seq_le(__u32 a, __u32 b) { return (__s32)(a - b) <= 0; }
/* RFC 7323's serial comparison of timestamps (replica::ts_before). */
static __always_inline int ts_before(__u32 a, __u32 b) { return (__s32)(b - a) > 0; }

static __always_inline int slow_locked(struct __sk_buff *skb, struct rep_b_entry *e)
{
	e->ctl |= REP_C_FROZEN;
	e->slow++;
	bpf_spin_unlock(&e->lock);
	skb->mark |= REP_MARK_SLOW;
	COUNT(slow);
	return FP_SLOW;
}

static __always_inline int slow(struct __sk_buff *skb, struct rep_b_entry *e)
{
	bpf_spin_lock(&e->lock);
	return slow_locked(skb, e);
}

/* Reads the state under the lock: 0 with `st` and `gen`, or the slow path's verdict (frozen). */
static __always_inline int snapshot(struct __sk_buff *skb, struct rep_b_entry *e, struct rep_b_state *st, __u32 *gen)
{
	bpf_spin_lock(&e->lock);
	if (e->ctl & REP_C_FROZEN)
		return slow_locked(skb, e);
	*st = e->s;
	*gen = e->gen;
	bpf_spin_unlock(&e->lock);
	return 0;
}

/* Writes `st` back if nothing changed the entry since `gen` was read: 0, or the slow path's
 * verdict (another packet of the connection was decided meanwhile). `changed`: sets
 * REP_C_CHANGED; *first says whether it was clear. */
static __always_inline int commit_state(struct __sk_buff *skb, struct rep_b_entry *e, const struct rep_b_state *st, __u32 gen, int changed, int *first)
{
	bpf_spin_lock(&e->lock);
	if ((e->ctl & REP_C_FROZEN) || e->gen != gen)
		return slow_locked(skb, e);
	e->s = *st;
	e->gen++;
	*first = changed && !(e->ctl & REP_C_CHANGED);
	if (changed)
		e->ctl |= REP_C_CHANGED;
	bpf_spin_unlock(&e->lock);
	return 0;
}

/* A client segment verifies (as in ckpt_tc.c's peer_csum_ok, the same three cases): the NIC
 * checked it, its sum is right, or its field holds the pseudo-header sum of a packet built on
 * this host (CHECKSUM_PARTIAL), which the daemon completes before the engine sees it. */
static __always_inline int client_csum_ok(struct __sk_buff *skb, const struct fp_pkt *p)
{
	if (bpf_csum_level(skb, BPF_CSUM_LEVEL_QUERY) >= 0)
		return 1;
	if (fp_l4_csum_partial(p))
		return 1;
	return fp_l4_csum_ok(skb, p);
}

static __always_inline int ack_only(const struct fp_pkt *p)
{
	__u8 f = ((const __u8 *)&p->th)[FP_TCP_FLAGS];

	return (f & (FP_ACK | FP_SYN | FP_FIN | FP_RST)) == FP_ACK;
}

static __always_inline void key_of(struct rep_key *k, const __u8 *client, __be16 client_port, __be16 server_port)
{
	__builtin_memcpy(k->client, client, 16);
	k->client_port = client_port;
	k->server_port = server_port;
}

/* The packet being copied in pieces (REP_REC_KEEP, _SLOW, _INPUT), a bpf_loop step each. Kept
 * off the stack (per CPU): only the skb crosses into the loop (rep_b_in's stack is full). */
struct keep_job {
	__u32 type;
	struct rep_key key;
	__u32 a;
	__u32 total;
	__u32 off;
	__s32 err;
	__u32 cpu;
	__u32 id;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct keep_job);
} rep_job SEC(".maps");

struct keep_ctx {
	struct __sk_buff *skb;
};

/* The job's next piece into the ring: 0, or 1 when the job is done or failed (j->err). */
static __always_inline long piece_out(struct __sk_buff *skb, struct keep_job *j)
{
	__u32 zero = 0;

	if (j->off >= j->total)
		return 1;
	struct rep_piece *pc = bpf_map_lookup_elem(&rep_piece_buf, &zero);
	if (!pc) {
		j->err = -1;
		return 1;
	}
	__u32 n = j->total - j->off;
	if (n > REP_KEEP_PIECE)
		n = REP_KEEP_PIECE;
	n = FP_BOUND(n, 2 * REP_KEEP_PIECE - 1);
	if (n == 0 || n > REP_KEEP_PIECE || bpf_skb_load_bytes(skb, FP_L3_ETH + j->off, pc->buf, n)) {
		j->err = -1;
		return 1;
	}
	pc->h.type = j->type;
	pc->h.len = n;
	pc->h.a = j->a;
	pc->h.b = j->total;
	pc->h.off = j->off;
	pc->h.cpu = j->cpu;
	pc->h.hash = 0;
	pc->h.key = j->key;
	pc->h.id = j->id;
	/* A copy of a declined packet (a SYN-ACK, a FIN: what the primary may be waiting for the
	 * backup's report of) wakes the daemon with its last piece; kept and input copies never do.
	 * Forced: the ring's adaptive wake-up (flags 0) fires only when the reader has consumed
	 * everything before the record, and the records written without one before it (the
	 * packet's earlier pieces, checkpoints, copies) are not: with 0 the daemon woke only on its
	 * timer, and strict output commit waited a beat (10 ms) per exchange. */
	__u64 wake = (j->type == REP_REC_SLOW && j->off + n >= j->total) ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
	if (bpf_ringbuf_output(&rep_records, pc, sizeof(pc->h) + n, wake)) {
		j->err = -1;
		return 1;
	}
	j->off += n;
	return 0;
}

static long keep_step(__u32 i, void *data)
{
	struct keep_ctx *x = data;
	__u32 zero = 0;
	struct keep_job *j = bpf_map_lookup_elem(&rep_job, &zero);

	if (!j)
		return 1;
	return piece_out(x->skb, j);
}

/* The job for a packet of `total` bytes (from its IP header), pieces of type `type` with `a` as
 * their first word, named by (CPU, that CPU's next packet number); NULL when the per-CPU
 * buffers are missing. */
static __always_inline struct keep_job *job(__u32 type, const struct rep_key *k, __u32 a, __u32 total)
{
	__u32 zero = 0;
	struct rep_piece *pc = bpf_map_lookup_elem(&rep_piece_buf, &zero);
	struct keep_job *j = bpf_map_lookup_elem(&rep_job, &zero);

	if (!pc || !j)
		return NULL;
	j->type = type;
	j->key = *k;
	j->a = a;
	j->total = total;
	j->off = 0;
	j->err = 0;
	j->cpu = bpf_get_smp_processor_id();
	j->id = pc->next_id++;
	return j;
}

/* Copies the packet (`total` bytes from its IP header) to the daemon in pieces of type `type`
 * (`a` their first word), each naming its packet by (CPU, that CPU's number of it), so that the
 * daemon never joins pieces of two packets (two CPUs' pieces interleave in the ring; one
 * packet's are consecutive, a program runs on one CPU): false when a piece was lost (counted). */
static __always_inline int copy_pieces(struct __sk_buff *skb, __u32 type, const struct rep_key *k, __u32 a, __u32 total)
{
	struct keep_job *j = job(type, k, a, total);

	if (!j) {
		COUNT(records_lost);
		return 0;
	}
	struct keep_ctx kx = { .skb = skb };
	if (bpf_loop(64, keep_step, &kx, 0) < 0 || j->err || j->off != j->total) {
		COUNT(records_lost);
		return 0;
	}
	return 1;
}

/* Backup::incoming for a client segment of an aligned connection. */
SEC("classifier")
int rep_b_in(struct __sk_buff *skb)
{
	struct fp_pkt p = {};
	struct rep_key k = {};
	struct rep_b_state c;
	const struct fp_opts *o = &p.o;
	__u32 gen;
	int first, r;

	if (fp_parse(skb, FP_L3_ETH, &p))
		return FP_SLOW;
	key_of(&k, p.src, p.th.source, p.th.dest);
	struct rep_b_entry *e = bpf_map_lookup_elem(&rep_b_conns, &k);
	if (!e)
		return FP_SLOW;
	/* A SYN (a new connection or a retransmission), FIN (client_fin), RST (client_rst), a
	 * segment without ACK: the engine's. So is one whose checksum fails (it drops and counts
	 * it) and one with options it would not parse. */
	if (!ack_only(&p) || !client_csum_ok(skb, &p) || fp_scan_options(&p))
		return slow(skb, e);
	__u32 len = fp_payload_len(&p);
	__u32 total = p.l4 - FP_L3_ETH + p.l4_len;
	/* Bytes in more than one piece of a copy (a GRO super-packet): the engine's. */
	if (len > 0 && total > REP_KEEP_PIECE)
		return slow(skb, e);
	if ((r = snapshot(skb, e, &c, &gen)))
		return r;
	if (!(c.flags & REP_B_ALIGNED))
		return slow(skb, e);

	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	__u32 has_ts = o->ts_at != 0;

	/* RFC 793's acceptability test against the window the backup's server announced: only such
	 * a segment teaches anything (a blind forgery must guess the client's sequence number). */
	int in_window = !(c.flags & REP_B_RCV_KNOWN) || (seq_ge(seq + len, c.rcv_nxt) && seq_le(seq, c.rcv_edge));
	if (in_window && has_ts && (!(c.flags & REP_B_TS_FLOOR) || ts_before(c.ts_floor, o->tsecr))) {
		c.ts_floor = o->tsecr;
		c.flags |= REP_B_TS_FLOOR;
	}
	/* An ACK beyond what the backup's server sent, where the primary did not report output
	 * that far: a blind forgery or ahead of the report; not learned (dropped in strict mode). */
	int beyond = seq_gt(ack - c.delta, c.snd_max) && !((c.flags & REP_B_P_OUT) && seq_le(ack, c.p_out));
	/* The client's newest timestamps, from a segment the backup's kernel takes: without strict
	 * output commit also one whose ACK is beyond (it passes clamped), else PAWS discards a
	 * relayed ACK that carries older ones. */
	if (in_window && !(beyond && (c.flags & REP_B_STRICT)) && has_ts && (!(c.flags & REP_B_CTS_MAX) || !ts_before(o->tsval, c.cts_max_val))) {
		c.cts_max_val = o->tsval;
		c.cts_max_ecr = o->tsecr;
		c.flags |= REP_B_CTS_MAX;
	}
	if (beyond && (c.flags & REP_B_STRICT)) {
		if ((r = commit_state(skb, e, &c, gen, 0, &first)))
			return r;
		if (!in_window)
			COUNT(unacceptable);
		COUNT(ack_unverified);
		COUNT(dropped_beyond);
		skb->mark |= REP_MARK_DONE;
		return FP_DROPPED_IN;
	}
	if (in_window && !beyond && (seq_gt(ack, c.last_ack) || !(c.flags & REP_B_CLIENT_SEEN))) {
		c.last_ack = ack;
		c.client_win = bpf_ntohs(p.th.window);
		if (has_ts) {
			c.cts_val = o->tsval;
			c.cts_ecr = o->tsecr;
			c.flags |= REP_B_CTS;
		} else {
			c.cts_val = c.cts_ecr = 0;
			c.flags &= ~REP_B_CTS;
		}
		__builtin_memcpy(c.server, p.dst, 16);
		c.flags |= REP_B_SERVER | REP_B_CLIENT_SEEN;
	}
	/* Into the backup's space, never beyond what its server sent (Linux discards a segment whose
	 * ACK covers unsent data, payload included). */
	int clamped = 0;
	__u32 ack_b = ack - c.delta;
	if (seq_gt(ack_b, c.snd_max)) {
		clamped = 1;
		ack_b = c.snd_max;
	}
	if (in_window && (!(c.flags & REP_B_ACKED_B) || seq_gt(ack_b, c.acked_b))) {
		c.acked_b = ack_b;
		c.flags |= REP_B_ACKED_B;
	}
	if (ack_b != ack)
		fp_set32(&p, FP_TCP_ACK, ack, ack_b);
	if (o->sack_at) {
		for (__u32 i = 0; i < 8; i++) {
			if (i >= o->sack_n * 2)
				break;
			__u32 at = o->sack_at + 2 + 4 * i;
			__u32 v = fp_opt32(&p, at - sizeof(struct tcphdr));
			__u32 w = v - c.delta;
			if (seq_gt(w, c.snd_max)) {
				clamped = 1;
				w = c.snd_max;
			}
			if (w != v)
				fp_set32(&p, at, v, w);
		}
	}
	if (has_ts && c.ts_off)
		fp_set32(&p, o->ts_at + 6, o->tsecr, o->tsecr - c.ts_off);

	if ((r = commit_state(skb, e, &c, gen, 0, &first)))
		return r;
	if (!in_window)
		COUNT(unacceptable);
	if (beyond)
		COUNT(ack_unverified);
	if (clamped)
		COUNT(ack_clamped);
	/* The state is written before the packet: a packet the kernel then fails to write is
	 * dropped (the client resends it), its facts already learned, which the engine would have
	 * learned from it too. */
	if (fp_commit(skb, &p)) {
		COUNT(dropped);
		return FP_DROP;
	}
	/* The client's bytes the backup's server takes: a copy for the primary (Backup::push_input),
	 * which the backup relays if the primary's host missed them (loss toward the primary). One
	 * piece (larger segments went to the engine): no bpf_loop here, whose callback's stack
	 * would add to this program's, which is full. */
	if (in_window && len > 0) {
		struct keep_job *j = job(REP_REC_INPUT, &k, 0, total);
		if (!j || piece_out(skb, j) || j->off != j->total)
			COUNT(records_lost);
	}
	skb->mark |= REP_MARK_DONE;
	COUNT(incoming);
	return FP_DONE;
}

/* FNV-1a over packet bytes (wire::replica::hash_continue), a FP_CHUNK piece per bpf_loop step. */
struct hash_ctx {
	struct __sk_buff *skb;
	__u64 h;
	__u32 off;  /* next byte (skb offset) */
	__u32 left; /* bytes still to hash */
	__s32 err;
};

static long hash_step(__u32 i, void *data)
{
	struct hash_ctx *x = data;
	__u32 zero = 0;

	if (!x->left)
		return 1;
	struct rep_cps *cp = bpf_map_lookup_elem(&rep_cp_buf, &zero);
	struct fp_scratch *s = bpf_map_lookup_elem(&fp_scratch, &zero);
	if (!s || !cp) {
		x->err = -1;
		return 1;
	}
	__u32 pos = cp->pos;
	if (pos != cp->start && !(pos & (REP_CP_STEP - 1))) {
		/* A step boundary reached with bytes still to come: a checkpoint. */
		__u32 k = FP_BOUND(cp->n, 127);
		if (k >= REP_CP_MAX) {
			x->err = -1;
			return 1;
		}
		cp->end[k] = pos;
		cp->hash[k] = x->h;
		cp->n = k + 1;
	}
	/* Pieces end at multiples of FP_CHUNK (which divides REP_CP_STEP). */
	__u32 n = FP_CHUNK - (pos & (FP_CHUNK - 1));
	if (n > x->left)
		n = x->left;
	n = FP_BOUND(n, 2 * FP_CHUNK - 1);
	if (n == 0 || n > FP_CHUNK || bpf_skb_load_bytes(x->skb, x->off, s->buf, n)) {
		x->err = -1;
		return 1;
	}
	__u64 h = x->h;
	for (__u32 j = 0; j < FP_CHUNK; j++) {
		if (j >= n)
			break;
		h ^= s->buf[j];
		h *= 0x100000001b3ULL;
	}
	x->h = h;
	x->off += n;
	x->left -= n;
	cp->pos = pos + n;
	return 0;
}

/* A record without bytes, built in the per-CPU piece buffer (the stack is the programs' scarcest
 * resource). */
static __always_inline void record(const struct rep_key *k, __u32 type, __u32 a, __u64 hash, __u64 flags)
{
	__u32 zero = 0;
	struct rep_piece *pc = bpf_map_lookup_elem(&rep_piece_buf, &zero);

	if (!pc) {
		COUNT(records_lost);
		return;
	}
	pc->h.type = type;
	pc->h.len = 0;
	pc->h.a = a;
	pc->h.b = 0;
	pc->h.off = 0;
	pc->h.cpu = 0;
	pc->h.hash = hash;
	pc->h.key = *k;
	pc->h.id = 0;
	if (bpf_ringbuf_output(&rep_records, &pc->h, sizeof(pc->h), flags))
		COUNT(records_lost);
}

/* Records the checkpoints rep_cp_buf kept (in order), a bpf_loop step each. */
struct cp_ctx {
	const struct rep_key *k;
};

static long cp_step(__u32 i, void *data)
{
	struct cp_ctx *x = data;
	__u32 zero = 0;
	struct rep_cps *cp = bpf_map_lookup_elem(&rep_cp_buf, &zero);
	__u32 j = FP_BOUND(i, 127);

	if (!cp || j >= REP_CP_MAX || j >= cp->n)
		return 1;
	record(x->k, REP_REC_CHECKPOINT, cp->end[j], cp->hash[j], BPF_RB_NO_WAKEUP);
	return 0;
}

/* What an egress program answers for a packet it declines (`v`, FP_SLOW): attached in copy mode,
 * a packet of the service goes to the daemon (REP_REC_SLOW pieces) and is consumed, never to
 * the wire as its server built it; otherwise (and for packets of other services) `v`. A packet
 * fp_parse refused is not the service's (the local stack builds TCP without IP options,
 * fragments or extension headers). */
/* What an egress program's wrapper needs of a packet it parsed. */
struct eg_info {
	__u8 src[16];
	__be16 sport;
	__u16 parsed;
	__u32 l4;
	__u32 l4_len;
	struct rep_key key;
	__u32 counted; /* the program counted the packet in its entry's slow (REP_REC_SLOW's a) */
	struct rep_svc svc; /* unparsed_from_service's lookup key */
};

/* Kept off the stack (per CPU): the egress programs' stack is full. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct eg_info);
} rep_eg SEC(".maps");

static __always_inline void eg_note(struct eg_info *g, const struct fp_pkt *p, const struct rep_key *k)
{
	__builtin_memcpy(g->src, p->src, 16);
	g->sport = p->th.source;
	g->l4 = p->l4;
	g->l4_len = p->l4_len;
	g->key = *k;
	g->parsed = 1;
}

static __always_inline int egress_declined(struct __sk_buff *skb, const struct eg_info *g, int v)
{
	__u32 zero = 0;
	struct rep_cfg *cfg = bpf_map_lookup_elem(&rep_cfg, &zero);

	if (v != FP_SLOW || !cfg || !(cfg->flags & REP_CFG_EGRESS_COPY) || !g->parsed)
		return v;
	struct rep_svc svc = {};
	__builtin_memcpy(svc.addr, g->src, 16);
	svc.port = g->sport;
	if (!bpf_map_lookup_elem(&rep_services, &svc))
		return v;
	copy_pieces(skb, REP_REC_SLOW, &g->key, g->counted, g->l4 - FP_L3_ETH + g->l4_len);
	return FP_CONSUMED;
}

/* Backup::outgoing for a segment of the backup's server on an aligned connection, before the
 * take-over: learned from, withheld. */
static __always_inline int b_out(struct __sk_buff *skb, struct eg_info *g)
{
	struct fp_pkt p = {};
	struct rep_key k = {};
	struct rep_b_state c;
	const struct fp_opts *o = &p.o;
	__u32 gen;
	int first, r;

	if (fp_parse(skb, FP_L3_ETH, &p))
		return FP_SLOW;
	key_of(&k, p.dst, p.th.dest, p.th.source);
	eg_note(g, &p, &k);
	struct rep_b_entry *e = bpf_map_lookup_elem(&rep_b_conns, &k);
	if (!e)
		return FP_SLOW;
	/* SYN-ACK (b_isn, alignment), RST (rst_out), FIN (fin_out), no ACK: the engine's. */
	if (!ack_only(&p) || fp_scan_options(&p))
		return slow(skb, e);
	__u64 now = bpf_ktime_get_ns();
	if ((r = snapshot(skb, e, &c, &gen)))
		return r;
	if (!(c.flags & REP_B_ALIGNED))
		return slow(skb, e);

	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	__u32 n = fp_payload_len(&p);

	if (o->ts_at && (!(c.flags & REP_B_B_TS) || !ts_before(o->tsval, c.b_ts_val))) {
		c.b_ts_val = o->tsval;
		c.b_ts_at = now;
		c.flags |= REP_B_B_TS;
	}
	__u32 end_b = seq + n;
	/* A resend of bytes the client's ACK already covered (as given to the server, or
	 * relayed): that ACK never arrived; the engine relays it again (acks_unheard). */
	if (n > 0 && (c.flags & REP_B_ACKED_B) && seq_le(end_b, c.acked_b))
		return slow(skb, e);
	if (seq_gt(end_b, c.snd_max))
		c.snd_max = end_b;
	/* What its server received: its ACK and right window edge. */
	if (!(c.flags & REP_B_RCV_KNOWN) || seq_gt(ack, c.rcv_nxt))
		c.rcv_nxt = ack;
	__u32 edge = ack + ((__u32)bpf_ntohs(p.th.window) << (c.ws_b & 15));
	if (!(c.flags & REP_B_RCV_KNOWN) || seq_gt(edge, c.rcv_edge))
		c.rcv_edge = edge;
	c.flags |= REP_B_RCV_KNOWN;
	/* learn_output: the digest continues with the bytes beyond out_end (primary's space).
	 * Without strict output commit only the end moves (no digest, no checkpoints: the primary
	 * releases without them). */
	__u32 sp = seq + c.delta;
	int learned = 0;
	if (n > 0) {
		__u32 e_p = sp + n;
		if (seq_le(sp, c.out_end) && seq_gt(e_p, c.out_end) && !(c.flags & REP_B_STRICT)) {
			c.out_end = e_p;
		} else if (seq_le(sp, c.out_end) && seq_gt(e_p, c.out_end)) {
			__u32 skip = c.out_end - sp;
			__u32 zero = 0;
			struct rep_cps *cp = bpf_map_lookup_elem(&rep_cp_buf, &zero);
			if (!cp)
				return slow(skb, e);
			cp->n = 0;
			cp->pos = c.out_end;
			cp->start = c.out_end;
			struct hash_ctx hx = { .skb = skb, .h = c.out_hash, .off = p.l4 + p.hdr_len + skip, .left = n - skip };
			if (bpf_loop(FP_CHUNKS + 2, hash_step, &hx, 0) < 0 || hx.err || hx.left)
				return slow(skb, e);
			c.out_hash = hx.h;
			c.out_end = e_p;
			learned = 1;
		} else if (seq_gt(sp, c.out_end)) {
			/* Beyond a gap (BConn::ooo, output_gap): the engine keeps it aside. */
			return slow(skb, e);
		}
	}
	if ((r = commit_state(skb, e, &c, gen, 1, &first)))
		return r;
	/* The daemon's records, in the engine's order: the checkpoint, the copy kept for the
	 * take-over (payload only), the connection's change (once per report). */
	if (learned) {
		struct cp_ctx cx = { .k = &k };
		bpf_loop(REP_CP_MAX, cp_step, &cx, 0);
		record(&k, REP_REC_CHECKPOINT, c.out_end, c.out_hash, BPF_RB_NO_WAKEUP);
	}
	if (n > 0)
		copy_pieces(skb, REP_REC_KEEP, &k, end_b, p.l4 - FP_L3_ETH + p.l4_len);
	/* The report the primary waits for: wakes the daemon whatever is unread before it (see
	 * the piece writer: an adaptive wake-up after the checkpoints above never fired). */
	if (first)
		record(&k, REP_REC_CHANGED, 0, 0, BPF_RB_FORCE_WAKEUP);
	skb->mark |= REP_MARK_DONE;
	COUNT(withheld);
	return FP_CONSUMED;
}

/* Review finding 2 of the attach: a packet fp_parse refused (an IPv4 BIG TCP packet whose
 * tot_len is 0, IP options, a fragment, IPv6 extension headers) that may be TCP from a service
 * address. Only the version, the protocol (IPv6: the first next header) and the source address
 * are read; the address's wildcard entry in rep_services (port 0) names it. */
static __always_inline int unparsed_from_service(struct __sk_buff *skb, struct eg_info *g)
{
	__u8 b[2] = {};
	struct rep_svc *svc = &g->svc;

	__builtin_memset(svc, 0, sizeof(*svc));
	if (bpf_skb_load_bytes(skb, FP_L3_ETH, b, 1))
		return 0;
	if (b[0] >> 4 == 4) {
		if (bpf_skb_load_bytes(skb, FP_L3_ETH + 9, &b[1], 1) || b[1] != IPPROTO_TCP)
			return 0;
		svc->addr[10] = svc->addr[11] = 0xff;
		if (bpf_skb_load_bytes(skb, FP_L3_ETH + 12, &svc->addr[12], 4))
			return 0;
	} else if (b[0] >> 4 == 6) {
		if (bpf_skb_load_bytes(skb, FP_L3_ETH + 6, &b[1], 1))
			return 0;
		/* TCP, or an extension header (hop-by-hop, routing, fragment, destination options)
		 * that may lead to it; ICMPv6 and the rest pass. */
		if (b[1] != IPPROTO_TCP && b[1] != 0 && b[1] != 43 && b[1] != 44 && b[1] != 60)
			return 0;
		if (bpf_skb_load_bytes(skb, FP_L3_ETH + 8, svc->addr, 16))
			return 0;
	} else {
		return 0;
	}
	return bpf_map_lookup_elem(&rep_services, svc) != NULL;
}

/* Attached at tc egress: declined packets of the service are copied and consumed in copy mode
 * (egress_declined). After the take-over (REP_CFG_PROMOTED: the OUTPUT queue rule takes the
 * server's packets) only what the queue accepted passes (own_mark, below). */
SEC("classifier")
int rep_b_out(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct rep_cfg *cfg = bpf_map_lookup_elem(&rep_cfg, &zero);
	struct eg_info *g = bpf_map_lookup_elem(&rep_eg, &zero);

	/* The daemon's own sends (translated by its engine already): never copied again. After the
	 * take-over the queue's accept verdicts carry the same mark (the daemon's accept mark on
	 * LOCAL_OUT), so what the engine translated passes. A packet without it passed the OUTPUT
	 * hook before the switch (review 2, finding 2: passed untouched it left in the backup's
	 * sequence space): consumed and copied like any declined packet, the engine translates it
	 * and the raw socket sends it. Without entries (the take-over clears the map) everything
	 * else is declined. */
	if (!g || (cfg && cfg->own_mark && skb->mark == cfg->own_mark))
		return FP_SLOW;
	__u32 mark0 = skb->mark;
	g->parsed = 0;
	int v = b_out(skb, g);
	/* Counted by slow(), which marks it: a mark the socket set before does not count. */
	g->counted = (skb->mark & REP_MARK_SLOW) && !(mark0 & REP_MARK_SLOW);
	/* Fail closed: what the parser refused from a service address never reaches the wire as
	 * the backup's server built it (the OUTPUT queue rule withheld it before the attach). The
	 * engine cannot read it either: dropped, counted (the backup may then fall behind on that
	 * connection and say so; never a byte to the client). */
	if (v == FP_SLOW && !g->parsed && cfg && (cfg->flags & REP_CFG_EGRESS_COPY) && unparsed_from_service(skb, g)) {
		COUNT(unparsed_dropped);
		return FP_DROP;
	}
	return egress_declined(skb, g, v);
}

/* The matches of the backup's queue rules (`iptables -m bpf --object-pinned`, pinned by the
 * daemon; review finding 4): the OUTPUT rule is in from the start and takes the server's packets
 * only once the daemon takes them through the queue again, the take-over (REP_CFG_PROMOTED) or a
 * lost egress filter (REP_CFG_USER_OUT), each one map write with no iptables command in the
 * packet loop. The rule outlives the daemon with this program and rep_cfg: a killed daemon's
 * last word stays (withheld at tc egress before the take-over, queued to nobody after it). */
SEC("socket")
int rep_q_out(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct rep_cfg *cfg = bpf_map_lookup_elem(&rep_cfg, &zero);

	/* No configuration (cannot happen: an array's entry always exists): queued, fail closed. */
	if (!cfg)
		return 1;
	return (cfg->flags & (REP_CFG_PROMOTED | REP_CFG_USER_OUT)) ? 1 : 0;
}

/* The PREROUTING rule's match: every client packet not decided by rep_b_in (those RETURN on
 * their mark before it). */
SEC("socket")
int rep_q_in(struct __sk_buff *skb)
{
	return 1;
}

/* The daemon's operations on an entry (rep_state.h), by BPF_PROG_TEST_RUN. Never attached. */
SEC("classifier")
int rep_op(struct __sk_buff *skb)
{
	struct rep_op_req rq = {};
	struct rep_op_ans an = {};

	if (bpf_skb_load_bytes(skb, FP_L3_ETH, &rq, sizeof(rq)))
		return 3;
	an.key = rq.key;
	struct rep_b_entry *e = bpf_map_lookup_elem(&rep_b_conns, &rq.key);
	if (!e) {
		an.result = 1;
		goto out;
	}
	bpf_spin_lock(&e->lock);
	an.ctl_before = e->ctl;
	switch (rq.op) {
	case REP_OP_TAKE:
		e->seen++;
		/* fall through */
	case REP_OP_FREEZE:
		e->ctl |= REP_C_FROZEN | REP_C_USER;
		break;
	case REP_OP_THAW:
		if (e->seen != e->slow) {
			an.result = 2;
			break;
		}
		/* fall through */
	case REP_OP_THAW_FORCE:
		e->seen = e->slow;
		e->ctl = 0;
		e->s = rq.value.s;
		e->gen++;
		break;
	case REP_OP_COLLECT:
		e->ctl &= ~REP_C_CHANGED;
		break;
	default:
		an.result = 3;
	}
	an.value.ctl = e->ctl;
	an.value.slow = e->slow;
	an.value.seen = e->seen;
	an.value.gen = e->gen;
	an.value.s = e->s;
	bpf_spin_unlock(&e->lock);
out:
	if (bpf_skb_store_bytes(skb, FP_L3_ETH, &an, sizeof(an), 0))
		return 3;
	return an.result;
}

/* ------------------------------------------------------------------------------------------ */
/* The primary's half: Primary::incoming and Primary::outgoing for pure ACKs of a protected,  */
/* established connection whose SYN-ACK went out (Koch 3.2's gate, issue 20's stamp).         */
/* ------------------------------------------------------------------------------------------ */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct rep_key);
	__type(value, struct rep_p_entry);
} rep_p_conns SEC(".maps");

/* When the primary's server last produced new output on a connection the programs carry
 * (Primary::last_output_ms; the kernel's clock, ns). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} rep_p_clock SEC(".maps");

/* Per CPU (unbroken_drivers::fastpath::replica::PrimaryCounters). */
struct rep_p_counters {
	__u64 incoming;     /* client pure ACKs claimed (learned, passed unchanged) */
	__u64 outgoing;     /* server pure ACKs claimed (gated) */
	__u64 slow;
	__u64 dropped;
	__u64 acks_lowered; /* PrimaryCounters::acks_lowered */
	__u64 ts_raised;    /* PrimaryCounters::ts_raised */
	__u64 unlearned;    /* client pure ACKs passed without learning (the entry was the daemon's) */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rep_p_counters);
} rep_p_stats SEC(".maps");

#define P_COUNT(field)                                          \
	({                                                      \
		__u32 __z = 0;                                  \
		struct rep_p_counters *__s = bpf_map_lookup_elem(&rep_p_stats, &__z); \
		if (__s)                                        \
			__s->field++;                           \
	})

/* The primary daemon's lease ran out (rep_cfg.lease): it is gone or stuck; nothing is claimed. */
static __always_inline int lease_over(void)
{
	__u32 zero = 0;
	struct rep_cfg *cfg = bpf_map_lookup_elem(&rep_cfg, &zero);

	return cfg && cfg->lease && bpf_ktime_get_ns() > cfg->lease;
}

static __always_inline int p_slow_locked(struct __sk_buff *skb, struct rep_p_entry *e)
{
	e->ctl |= REP_C_FROZEN;
	e->slow++;
	bpf_spin_unlock(&e->lock);
	skb->mark |= REP_MARK_SLOW;
	P_COUNT(slow);
	return FP_SLOW;
}

static __always_inline int p_slow(struct __sk_buff *skb, struct rep_p_entry *e)
{
	bpf_spin_lock(&e->lock);
	return p_slow_locked(skb, e);
}

static __always_inline int p_snapshot(struct __sk_buff *skb, struct rep_p_entry *e, struct rep_p_state *st, __u32 *gen)
{
	bpf_spin_lock(&e->lock);
	if (e->ctl & REP_C_FROZEN)
		return p_slow_locked(skb, e);
	*st = e->s;
	*gen = e->gen;
	bpf_spin_unlock(&e->lock);
	return 0;
}

static __always_inline int p_commit(struct __sk_buff *skb, struct rep_p_entry *e, const struct rep_p_state *st, __u32 gen)
{
	bpf_spin_lock(&e->lock);
	if ((e->ctl & REP_C_FROZEN) || e->gen != gen)
		return p_slow_locked(skb, e);
	e->s = *st;
	e->gen++;
	bpf_spin_unlock(&e->lock);
	return 0;
}

/* Primary::incoming for a client pure ACK (ACK only, no payload) that verifies: learned from,
 * never changed. A segment with payload is the slow path's (the copy kept for the relay to
 * the backup, keep_input, is not built here). */
SEC("classifier")
int rep_p_in(struct __sk_buff *skb)
{
	struct fp_pkt p = {};
	struct rep_key k = {};
	struct rep_p_state c;
	const struct fp_opts *o = &p.o;
	__u32 gen;
	int r;

	if (fp_parse(skb, FP_L3_ETH, &p))
		return FP_SLOW;
	key_of(&k, p.src, p.th.source, p.th.dest);
	struct rep_p_entry *e = bpf_map_lookup_elem(&rep_p_conns, &k);
	if (!e || lease_over())
		return FP_SLOW;
	if (!ack_only(&p) || fp_payload_len(&p) || !client_csum_ok(skb, &p) || fp_scan_options(&p))
		return p_slow(skb, e);
	__u64 now = bpf_ktime_get_ns();
	/* A pure ACK is passed unchanged whatever the engine learns from it (Primary::incoming
	 * never changes a client packet), and what it learns (the client's ACK, its last window
	 * and timestamps, when it was heard) the next one carries too. So while the daemon holds
	 * the entry (frozen), or another CPU changed it meanwhile, it passes without learning and
	 * without a count: under a steady stream, counted ACKs would keep the daemon's thaw
	 * refused (one arrives between its last take and its thaw) and the connection on the slow
	 * path for good. */
	bpf_spin_lock(&e->lock);
	if (e->ctl & REP_C_FROZEN) {
		/* Until the handshake is seen complete (`established`: the entry is never evicted
		 * from then on) the engine must learn it: to the queue, uncounted (the thaw does not
		 * wait for it). */
		int est = e->s.flags & REP_P_ESTABLISHED;
		bpf_spin_unlock(&e->lock);
		if (!est)
			return FP_SLOW;
		goto unlearned;
	}
	c = e->s;
	gen = e->gen;
	bpf_spin_unlock(&e->lock);
	if (!(c.flags & REP_P_ANSWERED))
		return p_slow(skb, e);
	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	/* Only from a segment the server's TCP would accept (a blind forgery must guess the
	 * client's sequence number). */
	int in_window = seq_ge(seq, c.ack_p) && seq_le(seq, c.edge_p);
	/* The handshake completed: an acceptable ACK of the SYN-ACK. */
	if (in_window && seq_ge(ack, c.stream_start) && seq_le(ack, c.snd_p))
		c.flags |= REP_P_ESTABLISHED;
	/* The client's ACK as the primary heard it, for the backup (ST-TCP 3.6). */
	if (in_window && seq_gt(ack, c.client_ack) && seq_le(ack, c.snd_p))
		c.client_ack = ack;
	if (in_window) {
		c.cl_end = seq;
		c.cl_win = bpf_ntohs(p.th.window);
		if (o->ts_at) {
			c.cl_ts_val = o->tsval;
			c.cl_ts_ecr = o->tsecr;
			c.flags |= REP_P_CL_TS;
		} else {
			c.cl_ts_val = c.cl_ts_ecr = 0;
			c.flags &= ~REP_P_CL_TS;
		}
		c.flags |= REP_P_CLIENT_LAST;
		c.heard_at = now;
	}
	bpf_spin_lock(&e->lock);
	if ((e->ctl & REP_C_FROZEN) || e->gen != gen) {
		int est = e->s.flags & REP_P_ESTABLISHED;
		bpf_spin_unlock(&e->lock);
		if (!est)
			return FP_SLOW;
		goto unlearned;
	}
	e->s = c;
	e->gen++;
	bpf_spin_unlock(&e->lock);
	skb->mark |= REP_MARK_DONE;
	P_COUNT(incoming);
	return FP_DONE;
unlearned:
	skb->mark |= REP_MARK_DONE;
	P_COUNT(unlearned);
	return FP_DONE;
}

/* Primary::outgoing for a segment of its server without SYN, FIN or RST: a pure ACK, a
 * retransmission of released bytes, or (without strict output commit) new output in order: the
 * ACK and window the client may see are the lower of both hosts' (Koch 3.2, gated), its TSval
 * never older than one already sent (stamp). */
static __always_inline int p_out(struct __sk_buff *skb, struct eg_info *g)
{
	struct fp_pkt p = {};
	struct rep_key k = {};
	struct rep_p_state c;
	const struct fp_opts *o = &p.o;
	__u32 gen;
	int r;

	if (fp_parse(skb, FP_L3_ETH, &p))
		return FP_SLOW;
	key_of(&k, p.dst, p.th.dest, p.th.source);
	eg_note(g, &p, &k);
	struct rep_p_entry *e = bpf_map_lookup_elem(&rep_p_conns, &k);
	if (!e || lease_over())
		return FP_SLOW;
	if (!ack_only(&p) || fp_scan_options(&p))
		return p_slow(skb, e);
	__u64 now = bpf_ktime_get_ns();
	if ((r = p_snapshot(skb, e, &c, &gen)))
		return r;
	if (!(c.flags & REP_P_ANSWERED))
		return p_slow(skb, e);
	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	__u16 win = bpf_ntohs(p.th.window);
	__u32 n = fp_payload_len(&p);
	__u32 end = seq + n;
	int lowered = 0, raised = 0, new_output = 0;

	/* Output: a retransmission of released bytes goes out at once (Koch 4); without strict
	 * output commit, new output too once the backup is aligned (ST-TCP; the entry exists only
	 * while nothing is held). Output beyond a gap, and new output held for the backup's digest
	 * (strict mode), are the engine's. */
	if (n > 0 && !seq_le(end, c.rel)) {
		if ((c.flags & REP_P_STRICT) || !(c.flags & REP_P_B_ALIGNED) || seq_gt(seq, c.p_end))
			return p_slow(skb, e);
		if (seq_gt(end, c.p_end)) {
			c.p_end = end;
			c.flags |= REP_P_OUT_SEEN;
			new_output = 1;
		}
		c.rel = c.p_end;
		if (seq_gt(end, c.snd_c))
			c.snd_c = end;
	}

	c.flags |= REP_P_ESTABLISHED;
	if (seq_gt(ack, c.ack_p))
		c.ack_p = ack;
	__u32 edge = ack + ((__u32)win << (c.ws_p & 15));
	if (seq_gt(edge, c.edge_p))
		c.edge_p = edge;
	if (o->ts_at) {
		c.ts_val = o->tsval;
		c.ts_ecr = o->tsecr;
		c.flags |= REP_P_TS;
	}
	if (seq_gt(end, c.snd_p))
		c.snd_p = end;
	if (seq_gt(end, c.p_max))
		c.p_max = end;
	/* stamp: the newest TSval sent (this packet's TSecr is the newest the server echoed). */
	if (o->ts_at) {
		if ((c.flags & REP_P_TS_MAX) && ts_before(o->tsval, c.ts_max)) {
			fp_set32(&p, o->ts_at + 2, o->tsval, c.ts_max);
			raised = 1;
		} else {
			c.ts_max = o->tsval;
			c.flags |= REP_P_TS_MAX;
		}
	}
	/* gated: the lower ACK and right edge of both hosts, once the backup reported. */
	if ((c.flags & (REP_P_B | REP_P_B_RCV_KNOWN)) == (REP_P_B | REP_P_B_RCV_KNOWN)) {
		__u32 g_ack = seq_lt(c.ack_p, c.b_rcv_nxt) ? c.ack_p : c.b_rcv_nxt;
		__u32 g_edge = seq_lt(c.edge_p, c.b_rcv_edge) ? c.edge_p : c.b_rcv_edge;
		__u32 w = seq_gt(g_edge, g_ack) ? g_edge - g_ack : 0;
		w >>= (c.ws_p & 15);
		__u16 g_win = w > 0xffff ? 0xffff : (__u16)w;
		if (g_ack != ack) {
			if (seq_lt(g_ack, ack))
				lowered = 1;
			fp_set32(&p, FP_TCP_ACK, ack, g_ack);
		}
		if (g_win != win)
			fp_set16(&p, FP_TCP_WINDOW, win, g_win);
		if (!(c.flags & REP_P_SENT_ACK) || seq_gt(g_ack, c.sent_ack)) {
			c.sent_ack = g_ack;
			c.flags |= REP_P_SENT_ACK;
		}
	}
	if ((r = p_commit(skb, e, &c, gen)))
		return r;
	if (new_output) {
		/* Primary::last_output_ms: its server is not stalled (the daemon reads it). */
		__u32 zero = 0;
		__u64 *t = bpf_map_lookup_elem(&rep_p_clock, &zero);
		if (t)
			*t = now;
	}
	if (fp_commit(skb, &p)) {
		P_COUNT(dropped);
		return FP_DROP;
	}
	if (lowered)
		P_COUNT(acks_lowered);
	if (raised)
		P_COUNT(ts_raised);
	skb->mark |= REP_MARK_DONE;
	P_COUNT(outgoing);
	return FP_DONE;
}

/* Attached at tc egress: declined packets of the service are copied and consumed in copy mode
 * (egress_declined). */
SEC("classifier")
int rep_p_out(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct eg_info *g = bpf_map_lookup_elem(&rep_eg, &zero);
	struct rep_cfg *cfg = bpf_map_lookup_elem(&rep_cfg, &zero);

	/* The daemon's own sends (released or built by its engine): never copied again. */
	if (!g || (cfg && cfg->own_mark && skb->mark == cfg->own_mark))
		return FP_SLOW;
	__u32 mark0 = skb->mark;
	g->parsed = 0;
	int v = p_out(skb, g);
	g->counted = (skb->mark & REP_MARK_SLOW) && !(mark0 & REP_MARK_SLOW);
	/* Fail closed, as rep_b_out (review of the primary's attach, finding 1): what the parser
	 * refused from a service address (IPv4 BIG TCP's tot_len 0, IP options, ...) never leaves
	 * ungated, with the OUTPUT queue rule no longer in its way: dropped, counted. */
	if (v == FP_SLOW && !g->parsed && cfg && (cfg->flags & REP_CFG_EGRESS_COPY) && unparsed_from_service(skb, g)) {
		COUNT(unparsed_dropped);
		return FP_DROP;
	}
	return egress_declined(skb, g, v);
}

/* The daemon's operations on a primary entry (REP_OP_*; COLLECT reads it). Never attached. */
SEC("classifier")
int rep_p_op(struct __sk_buff *skb)
{
	struct rep_p_op_req rq = {};

	if (bpf_skb_load_bytes(skb, FP_L3_ETH, &rq, sizeof(rq)))
		return 3;
	__u32 op = rq.op, result = 0;
	/* REP_OP_REPORT's clock: read before the lock (no helper calls under it). */
	__u64 now = bpf_ktime_get_ns();
	struct rep_p_entry *e = bpf_map_lookup_elem(&rep_p_conns, &rq.key);
	if (!e) {
		result = 1;
		goto out;
	}
	bpf_spin_lock(&e->lock);
	rq.pad = e->ctl;
	switch (op) {
	case REP_OP_TAKE:
		e->seen++;
		/* fall through */
	case REP_OP_FREEZE:
		e->ctl |= REP_C_FROZEN | REP_C_USER;
		break;
	case REP_OP_THAW:
		if (e->seen != e->slow) {
			result = 2;
			break;
		}
		/* fall through */
	case REP_OP_THAW_FORCE:
		e->seen = e->slow;
		e->ctl = 0;
		e->s = rq.value.s;
		e->gen++;
		break;
	case REP_OP_COLLECT:
		break;
	case REP_OP_REPORT: {
		/* Primary::backup_progress's receive figures for a connection the programs own:
		 * the gate follows the backup without a freeze. */
		if (e->ctl & REP_C_FROZEN) {
			result = 2;
			break;
		}
		const struct rep_p_state *r = &rq.value.s;
		struct rep_p_state *s = &e->s;
		if (r->flags & REP_P_B_RCV_KNOWN) {
			int known = (s->flags & (REP_P_B | REP_P_B_RCV_KNOWN)) == (REP_P_B | REP_P_B_RCV_KNOWN);
			if (!known || seq_gt(r->b_rcv_nxt, s->b_rcv_nxt))
				s->b_rcv_nxt = r->b_rcv_nxt;
			if (!known || seq_gt(r->b_rcv_edge, s->b_rcv_edge))
				s->b_rcv_edge = r->b_rcv_edge;
			s->flags |= REP_P_B_RCV_KNOWN;
		}
		s->flags |= REP_P_B;
		if (r->flags & REP_P_B_ALIGNED)
			s->flags |= REP_P_B_ALIGNED;
		e->gen++;
		/* Koch 3.4's fresh ACK: the gated ACK passed the last one sent. (A backup behind in
		 * the client's bytes is left to the engine's timers, which run on these fields: what
		 * they answer, duplicate ACKs that make the client resend, takes the entry then.) */
		int fresh = 0;
		if ((s->flags & (REP_P_SENT_ACK | REP_P_B_RCV_KNOWN)) == (REP_P_SENT_ACK | REP_P_B_RCV_KNOWN)) {
			__u32 g = seq_lt(s->ack_p, s->b_rcv_nxt) ? s->ack_p : s->b_rcv_nxt;
			fresh = seq_gt(g, s->sent_ack);
		}
		/* The client's ACK relayed from the backup into this host's server (issue 20). */
		int relay = r->client_ack != 0 && (s->flags & REP_P_CLIENT_LAST) && now >= s->heard_at + REP_P_RELAY_QUIET_NS &&
			    seq_gt(r->client_ack, s->client_ack) && seq_le(r->client_ack, s->snd_c);
		if (fresh || relay) {
			e->ctl |= REP_C_FROZEN | REP_C_USER;
			result = REP_OP_TAKEN;
		}
		break;
	}
	default:
		result = 3;
	}
	rq.value.ctl = e->ctl;
	rq.value.slow = e->slow;
	rq.value.seen = e->seen;
	rq.value.gen = e->gen;
	rq.value.s = e->s;
	bpf_spin_unlock(&e->lock);
out:
	rq.op = result;
	if (bpf_skb_store_bytes(skb, FP_L3_ETH, &rq, sizeof(rq), 0))
		return 3;
	return result;
}
