/* Object mode's fast path: which packets of a protected connection must reach the agent's
 * slow path (the TRODS engine behind NFQUEUE) and which may pass without leaving the kernel,
 * decided as crates/engines/src/trods.rs would decide them (the table in
 * docs/architecture.md, "Fast path: object mode", names the engine's code for every row).
 *
 *   obj_from_client  socket filter, the client's packets (mangle PREROUTING:
 *                    `-m bpf --object-pinned ... -j NFQUEUE`): 1 = slow, 0 = pass
 *   obj_to_client    socket filter, the server's packets (mangle OUTPUT), the same
 *   obj_to_client_tc tc egress: the one rewrite the engine makes on a packet it passes, the
 *                    server's ACK lowered to the stored hold (trods::limit_ack), on the server
 *                    packets obj_to_client passed (those the slow path decided carry its mark)
 *
 * Only a client's pure ACK and a server segment continuing a stored response's body (or
 * carrying nothing new), or either on an unprotected connection the engine only passes
 * through, ever pass: everything that starts, ends or changes anything the engine decides with
 * goes slow. What the engine would have counted on a passed packet (the client's
 * ACK, the server's sent bytes, its window and timestamps, the time) the kernel keeps in the
 * entry, for the agent to read back. Attached by the agent (`agent.fast_path`).
 */
#include "../common/fastpath.h"
#include "obj_state.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define OBJ_SLOW 1
#define OBJ_PASS 0

/* The agent's mark: the ACKs its engine builds are sent with it (its queue rules let them
 * pass), and its NFQUEUE verdicts are to put it on every packet the slow path decided. The tc
 * program leaves those alone: the engine decided their ACK (an injected one may acknowledge the
 * client's FIN past the published limit, once the engine lifted it). Set by the loader. */
volatile const __u32 obj_decided_mark = 0x7562;

/* Take a client packet whose checksum field holds only the pseudo-header's sum as one whose
 * checksum the kernel has not computed yet (CHECKSUM_PARTIAL: built on this host, or sent
 * through a veth by a local namespace), which the engine trusts when NFQUEUE says so
 * (`csum_not_ready`). A socket filter cannot read ip_summed; a corrupted packet from the wire
 * with that value (one in 65,536) would pass too, and the kernel's TCP drops it. Off unless
 * the loader sets it. */
volatile const __u32 obj_trust_partial_csum = 0;

/* Engine constants: trods::FAR_PAST_PROGRESS is folded into sent_wall by the agent. */
#define OBJ_WIN_MIN (1u << 16)
#define OBJ_WIN_MAX (1u << 30)

/* The connection's slot in obj_slots. Written by the agent once per connection (removed when
 * the engine forgets it; a freed slot is reused only after a quarantine far longer than any
 * program run, so a program that found the old slot cannot write into a new connection). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct obj_key);
	__type(value, __u32);
} obj_index SEC(".maps");

/* The entries, in memory the agent maps into its address space (BPF_F_MMAPABLE): it takes an
 * entry with an atomic `or` of OBJ_F_USER and publishes one in place, never replacing an element
 * a program may still hold (docs: the hand-off). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct obj_conn);
} obj_slots SEC(".maps");

/* Per bucket: CLOCK_MONOTONIC ns until which this server holds the LB's lease on it and owns
 * it (0: not owned). The agent writes it at every heartbeat reply (agentcore's fence), into
 * memory it maps (a heartbeat every few ms would be a system call per bucket otherwise). The
 * last entry (OBJ_ALIVE_SLOT) is the agent's own lease. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, OBJ_BUCKETS + 1);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, __u64);
} obj_leases SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, OBJ_C_N);
	__type(key, __u32);
	__type(value, __u64);
} obj_counters SEC(".maps");

static __always_inline void obj_count(__u32 i)
{
	__u64 *c = bpf_map_lookup_elem(&obj_counters, &i);
	if (c)
		*c += 1;
}

/* unbroken_wire::seq::unwrap_near: the 64-bit offset congruent to `low` nearest `ref`. */
static __always_inline __u64 unwrap_near(__u32 low, __u64 ref)
{
	__s64 d = (__s32)(low - (__u32)ref);
	__s64 r = (__s64)ref + d;
	return r < 0 ? 0 : (__u64)r;
}

static __always_inline __u64 min64(__u64 a, __u64 b) { return a < b ? a : b; }
static __always_inline __u64 max64(__u64 a, __u64 b) { return a > b ? a : b; }

static __always_inline __u8 tcp_flags(const struct fp_pkt *p)
{
	return ((const __u8 *)&p->th)[FP_TCP_FLAGS];
}

/* The TCP checksum of a segment without payload (the header is all of it, zero past hdr_len
 * in p->hdr): the pseudo-header and 30 words. The engine's tcp_checksum_ok. */
static __always_inline int obj_header_csum_ok(const struct fp_pkt *p)
{
	__u64 s = IPPROTO_TCP + (p->l4_len & 0xffff) + (p->l4_len >> 16);
	int i;

	if (p->v6) {
#pragma unroll
		for (i = 0; i < 16; i += 2)
			s += ((__u32)p->src[i] << 8 | p->src[i + 1]) + ((__u32)p->dst[i] << 8 | p->dst[i + 1]);
	} else {
#pragma unroll
		for (i = 12; i < 16; i += 2)
			s += ((__u32)p->src[i] << 8 | p->src[i + 1]) + ((__u32)p->dst[i] << 8 | p->dst[i + 1]);
	}
#pragma unroll
	for (i = 0; i < 60; i += 2)
		s += (__u32)p->hdr[i] << 8 | p->hdr[i + 1];
	return fp_fold(s) == 0xffff;
}

/* Whether the checksum field holds the folded pseudo-header sum: what a Linux sender leaves
 * in a CHECKSUM_PARTIAL segment (__tcp_v4_send_check, __tcp_v6_send_check). */
static __always_inline int obj_csum_partial(const struct fp_pkt *p)
{
	__u64 s = IPPROTO_TCP + (p->l4_len & 0xffff) + (p->l4_len >> 16);
	int i;

	if (p->v6) {
#pragma unroll
		for (i = 0; i < 16; i += 2)
			s += ((__u32)p->src[i] << 8 | p->src[i + 1]) + ((__u32)p->dst[i] << 8 | p->dst[i + 1]);
	} else {
#pragma unroll
		for (i = 12; i < 16; i += 2)
			s += ((__u32)p->src[i] << 8 | p->src[i + 1]) + ((__u32)p->dst[i] << 8 | p->dst[i + 1]);
	}
	return fp_fold(s) == bpf_ntohs(p->th.check);
}

/* The bucket marker in the frame's source MAC (unbroken_wire::marker): 0 and *b set, or -1
 * when there is none (or no MAC header). */
static __always_inline int obj_marker(struct __sk_buff *skb, __u16 *b)
{
	__u8 mac[6];

	if (bpf_skb_load_bytes_relative(skb, 6, mac, 6, BPF_HDR_START_MAC))
		return -1;
	if (mac[0] != 0x02 || mac[1] != 0x75 || mac[2] != 0x62 || mac[3] != 0x00)
		return -1;
	*b = (__u16)mac[4] << 8 | mac[5];
	return 0;
}

/* Whether the agent that published the entries is alive at `now` (its own lease). */
static __always_inline int obj_agent_alive(__u64 now)
{
	__u32 i = OBJ_ALIVE_SLOT;
	__u64 *until = bpf_map_lookup_elem(&obj_leases, &i);

	return until && now < *until;
}

static __always_inline struct obj_conn *obj_entry(const struct obj_key *k)
{
	__u32 *slot = bpf_map_lookup_elem(&obj_index, k);

	if (!slot)
		return NULL;
	__u32 i = *slot;
	return bpf_map_lookup_elem(&obj_slots, &i);
}

/* The entry's flags, then a copy of it: the agent publishes every other field before it
 * clears OBJ_F_USER (a release store), so a copy made after flags were read without it holds
 * the published values (the atomic is a full barrier). */
static __always_inline __u32 obj_load(struct obj_conn *e, struct obj_conn *c)
{
	__u32 flags = __sync_fetch_and_or(&e->flags, 0);

	*c = *e;
	return flags;
}

/* The kept fields are written between two increments of wseq, and only while OBJ_F_USER is
 * clear after the first and the publication is still the one the packet was judged against
 * (`gen`, read by obj_load): a reader that saw OBJ_F_USER and an even wseq twice around its
 * read has every passed packet's update (docs: the hand-off), and a program that stalled while
 * the agent took the entry and published it again (new walls, perhaps muted) does not pass its
 * packet on the old ones. 0 to go on, -1 when the entry went to user space or was published
 * again meanwhile (the packet goes slow). */
static __always_inline int obj_write_begin(struct obj_conn *e, __u16 gen)
{
	__sync_fetch_and_add(&e->wseq, 1);
	if ((__sync_fetch_and_or(&e->flags, 0) & OBJ_F_USER) || *(volatile __u16 *)&e->pub_gen != gen) {
		__sync_fetch_and_add(&e->wseq, 1);
		return -1;
	}
	return 0;
}

static __always_inline void obj_write_end(struct obj_conn *e)
{
	__sync_fetch_and_add(&e->wseq, 1);
}

/* A packet of a known connection goes slow: the entry is the slow path's until the agent
 * publishes it again (both directions). */
static __always_inline int obj_slow(struct obj_conn *e, __u32 counter)
{
	__sync_fetch_and_or(&e->flags, OBJ_F_USER);
	obj_count(counter);
	return OBJ_SLOW;
}

/* A packet of an entry that is the agent's already goes slow without touching it: set again
 * late (after the agent published the entry meanwhile), OBJ_F_USER would take back an entry for
 * a packet that was slow only because of it. */
static __always_inline int obj_user(__u32 counter)
{
	obj_count(counter);
	return OBJ_SLOW;
}

/* The client's packets. trods::Engine::packet_parsed (Dir::FromClient) and on_client. */
SEC("socket")
int obj_from_client(struct __sk_buff *skb)
{
	struct fp_pkt p = {};
	struct obj_key k = {};

	if (fp_parse(skb, 0, &p))
		return OBJ_SLOW;
	__builtin_memcpy(k.client_addr, p.src, 16);
	__builtin_memcpy(k.service_addr, p.dst, 16);
	__builtin_memcpy(k.client_port, &p.th.source, 2);
	__builtin_memcpy(k.service_port, &p.th.dest, 2);
	struct obj_conn *e = obj_entry(&k);
	if (!e)
		return OBJ_SLOW;
	struct obj_conn c;
	__u32 flags = obj_load(e, &c);
	if (flags & OBJ_F_USER)
		return obj_user(OBJ_C_CLIENT_SLOW);
	if (!(flags & OBJ_F_CLIENT_FAST))
		return obj_slow(e, OBJ_C_CLIENT_SLOW);
	/* No live agent: nothing passes (its successor must see every packet). */
	__u64 now = bpf_ktime_get_ns();
	if (!obj_agent_alive(now))
		return obj_slow(e, OBJ_C_CLIENT_SLOW);
	/* SYN (filed, challenged), RST (RFC 5961), FIN (the client's close), no ACK, and any
	 * payload (request bytes, retransmissions, out-of-window data): the engine's. */
	__u8 f = tcp_flags(&p);
	if ((f & (FP_SYN | FP_FIN | FP_RST | FP_ACK)) != FP_ACK || fp_payload_len(&p))
		return obj_slow(e, OBJ_C_CLIENT_SLOW);
	/* The core records the bucket the marker names (agentcore: `buckets`): a new one is news. */
	__u16 b;
	if (!obj_marker(skb, &b) && (!(flags & OBJ_F_BUCKET_KNOWN) || b != c.bucket))
		return obj_slow(e, OBJ_C_CLIENT_SLOW);
	/* A wrong checksum is dropped and counted (bad_checksum). */
	if (!obj_header_csum_ok(&p) && !(obj_trust_partial_csum && obj_csum_partial(&p)))
		return obj_slow(e, OBJ_C_CLIENT_SLOW);
	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	/* Conn::in_window(seq, 0): outside, out_of_window (and nothing else is checked). */
	__s32 d = (__s32)(seq - (c.irs + 1 + (__u32)c.cli_next));
	__u64 w = (__u64)c.last_window << (c.server_ws < 14 ? c.server_ws : 14);
	w = w < OBJ_WIN_MIN ? OBJ_WIN_MIN : w > OBJ_WIN_MAX ? OBJ_WIN_MAX : w;
	if (d < 0 || (__s64)d >= (__s64)w)
		return obj_slow(e, OBJ_C_CLIENT_SLOW);
	/* The ACK as a server offset (Conn::srv_off). Past what the server sent: ack_unsent_dropped,
	 * or on a rebuilt socket acks_unsent / keeps_acking_unsent (superseded). At or past the
	 * first stored response's end: prunes it (a store). */
	__u64 a = unwrap_near(ack - (c.iss + 1), c.sent_next);
	if (a > c.sent_next || a >= c.ack_wall)
		return obj_slow(e, OBJ_C_CLIENT_SLOW);

	if (obj_write_begin(e, c.pub_gen))
		return obj_slow(e, OBJ_C_CLIENT_SLOW);
	/* (An unprotected connection's engine learns nothing from the ACK: on_client returns
	 * before it.) */
	if (a > e->client_acked && !(flags & OBJ_F_PASSTHROUGH))
		e->client_acked = a;
	e->last_seen_ns = now;
	obj_write_end(e);
	obj_count(OBJ_C_CLIENT_PASSED);
	return OBJ_PASS;
}

/* The server's packets. agentcore's fence, then trods::Engine::packet_parsed (Dir::ToClient)
 * and on_server. */
SEC("socket")
int obj_to_client(struct __sk_buff *skb)
{
	struct fp_pkt p = {};
	struct obj_key k = {};

	if (fp_parse(skb, 0, &p))
		return OBJ_SLOW;
	__builtin_memcpy(k.client_addr, p.dst, 16);
	__builtin_memcpy(k.service_addr, p.src, 16);
	__builtin_memcpy(k.client_port, &p.th.dest, 2);
	__builtin_memcpy(k.service_port, &p.th.source, 2);
	struct obj_conn *e = obj_entry(&k);
	if (!e)
		return OBJ_SLOW;
	struct obj_conn c;
	__u32 flags = obj_load(e, &c);
	if (flags & OBJ_F_USER)
		return obj_user(OBJ_C_SERVER_SLOW);
	if (!(flags & OBJ_F_SERVER_FAST))
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	/* SYN-ACK (a connection), RST (forget), FIN (srv_fin, the record's end), no ACK. */
	__u8 f = tcp_flags(&p);
	if ((f & (FP_SYN | FP_FIN | FP_RST | FP_ACK)) != FP_ACK)
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	__u64 now = bpf_ktime_get_ns();
	if (!obj_agent_alive(now))
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	/* The fence: only under a lease on a bucket this server owns. */
	if (!(flags & OBJ_F_NO_FENCE)) {
		if (!(flags & OBJ_F_BUCKET_KNOWN))
			return obj_slow(e, OBJ_C_SERVER_SLOW);
		__u32 bk = c.bucket;
		__u64 *lease = bpf_map_lookup_elem(&obj_leases, &bk);
		if (!lease || now >= *lease)
			return obj_slow(e, OBJ_C_SERVER_SLOW);
	}
	/* Options: a SACK option is limit_ack's to judge; a malformed or unknown option, or a
	 * second timestamp, is the engine parser's. */
	if (fp_scan_options(&p) || p.o.sack_at || p.o.ts_n > 1)
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	__u32 seq = bpf_ntohl(p.th.seq);
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	__u32 len = fp_payload_len(&p);
	/* on_server: a gap (server_gaps, dropped); new bytes past the body being parsed (a new
	 * response header: an entry, a store, held); a progress mark due (held, a store). */
	__u64 off = unwrap_near(seq - (c.iss + 1), c.sent_next);
	__u64 end = off + len;
	/* (An unprotected connection's stream is not parsed: only sent_next moves.) */
	int parsed = !(flags & OBJ_F_PASSTHROUGH);
	if (parsed && (off > c.srv_next || (end > c.srv_next && end > c.body_end)))
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	if (parsed && max64(c.sent_next, end) >= c.sent_wall)
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	/* The server's ACK: news of client bytes (srv_ack), a pure ACK past the hold (dropped),
	 * or more told to the client than before (told). */
	__u64 a = unwrap_near(ack - (c.irs + 1), c.cli_next);
	if (min64(a, c.srv_ack_cap) > c.srv_ack)
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	if (c.ack_limit != OBJ_NONE) {
		__u32 limit = c.irs + 1 + (__u32)c.ack_limit;
		if (!len && seq_gt(ack, limit))
			return obj_slow(e, OBJ_C_SERVER_SLOW);
	}
	if (min64(a, c.ack_limit) > c.told)
		return obj_slow(e, OBJ_C_SERVER_SLOW);

	if (obj_write_begin(e, c.pub_gen))
		return obj_slow(e, OBJ_C_SERVER_SLOW);
	if (parsed)
		e->srv_next = max64(e->srv_next, end);
	e->sent_next = max64(e->sent_next, end);
	e->last_window = bpf_ntohs(p.th.window);
	e->has_ts = p.o.ts_at != 0;
	e->last_tsval = p.o.ts_at ? p.o.tsval : 0;
	e->last_tsecr = p.o.ts_at ? p.o.tsecr : 0;
	e->last_seen_ns = now;
	obj_write_end(e);
	obj_count(OBJ_C_SERVER_PASSED);
	return OBJ_PASS;
}

/* tc egress: trods::limit_ack on the server packets obj_to_client passed. The limit only
 * rises, and is always a stored hold, so lowering to the entry's current one is what the
 * engine does with any packet it passes after the store that raised it. */
SEC("classifier")
int obj_to_client_tc(struct __sk_buff *skb)
{
	struct fp_pkt p = {};
	struct obj_key k = {};

	if (skb->mark == obj_decided_mark)
		return FP_DONE;
	if (fp_parse(skb, FP_L3_ETH, &p))
		return FP_DONE;
	__builtin_memcpy(k.client_addr, p.dst, 16);
	__builtin_memcpy(k.service_addr, p.src, 16);
	__builtin_memcpy(k.client_port, &p.th.dest, 2);
	__builtin_memcpy(k.service_port, &p.th.source, 2);
	struct obj_conn *e = obj_entry(&k);
	if (!e)
		return FP_DONE;
	__u64 l = e->ack_limit;
	if (l == OBJ_NONE || !(tcp_flags(&p) & FP_ACK))
		return FP_DONE;
	__u32 limit = e->irs + 1 + (__u32)l;
	__u32 ack = bpf_ntohl(p.th.ack_seq);
	if (!seq_gt(ack, limit))
		return FP_DONE;
	/* (obj_to_client passes no SACK option; one here was not passed by it.) */
	if (fp_scan_options(&p) || p.o.sack_at)
		return FP_DONE;
	fp_set32(&p, FP_TCP_ACK, ack, limit);
	if (fp_commit(skb, &p))
		return FP_DROP;
	obj_count(OBJ_C_ACKS_LOWERED);
	return FP_DONE;
}
