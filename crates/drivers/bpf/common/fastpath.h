/* What every mode's tc program shares: the two verdicts, one parse of the IP and TCP headers
 * (through bpf_skb_load_bytes, so a socket filter, which sees the packet from its IP header and
 * has no direct packet access, can call the same code with l3 = 0), the TCP options walk,
 * verification of a TCP checksum, and edits of the TCP header written back with one incremental
 * checksum update.
 *
 * Offsets named `at` are relative to the start of the TCP header. Values read from the packet
 * are kept in host order; rewrites take host order and store network order.
 */
#pragma once

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* Verdicts of a fast-path program. FP_DONE: the fast path claimed the packet and decided it
 * exactly as the mode's Rust engine would (the packet goes on, rewritten where needed).
 * FP_SLOW: not claimed, and not a byte changed: the slow path (the engine behind NFQUEUE)
 * must decide it. TC_ACT_UNSPEC lets the packet continue (the next tc program, else the stack),
 * so an attached program hands the packet on to netfilter, where the steering rule sends it to
 * the queue (see docs/architecture.md, "Fast path"). The
 * per-connection state is written before the rewrite reaches the packet (see the mode's
 * program for why that is safe). */
#define FP_DONE TC_ACT_OK
#define FP_SLOW TC_ACT_UNSPEC
/* A rewrite failed halfway (the kernel could not make the skb writable): the packet is
 * neither the original nor the engine's answer, so it is dropped (TCP resends it) and the
 * state is left as it was. */
#define FP_DROP TC_ACT_SHOT

/* Where the IP header starts in what a tc program sees on an Ethernet device (and in
 * BPF_PROG_TEST_RUN, which takes an Ethernet frame). */
#define FP_L3_ETH ETH_HLEN

#define FP_IP_MF 0x2000
#define FP_IP_OFFSET 0x1fff

/* TCP flag bits (byte 13 of the header). */
#define FP_FIN 0x01
#define FP_SYN 0x02
#define FP_RST 0x04
#define FP_ACK 0x10

/* TCP option kinds the engines understand (unbroken_wire::tcp::kind). */
#define FP_OPT_EOL 0
#define FP_OPT_NOP 1
#define FP_OPT_MSS 2
#define FP_OPT_WSCALE 3
#define FP_OPT_SACK_PERM 4
#define FP_OPT_SACK 5
#define FP_OPT_TIMESTAMP 8

/* Byte offsets in the TCP header. */
#define FP_TCP_SEQ 4
#define FP_TCP_ACK 8
#define FP_TCP_FLAGS 13
#define FP_TCP_WINDOW 14
#define FP_TCP_CHECK 16

/* A segment's checksum is verified in chunks of this size through a per-CPU buffer. */
#define FP_CHUNK 512
/* At most this many full chunks: 64 KiB, the largest IP packet (GSO and GRO included). */
#define FP_CHUNKS 128

/* `x & mask`, the mask kept even where clang can prove it redundant: the verifier tracks the
 * bound of an index only through what the program computes, and refuses a stack read at an
 * offset it cannot bound inside the array. */
#define FP_BOUND(x, mask)                          \
	({                                         \
		__u32 __v = (x);                   \
		asm volatile("" : "+r"(__v));      \
		__v & (mask);                      \
	})

/* Modular sequence comparisons (unbroken_wire::Seq). */
static __always_inline int seq_lt(__u32 a, __u32 b) { return (__s32)(a - b) < 0; }
static __always_inline int seq_gt(__u32 a, __u32 b) { return (__s32)(a - b) > 0; }
static __always_inline int seq_ge(__u32 a, __u32 b) { return (__s32)(a - b) >= 0; }

/* What the options walk found. Offsets 0 mean absent (an option starts at 20 or later). */
struct fp_opts {
	__u32 ts_at;   /* the timestamp option */
	__u32 tsval;
	__u32 tsecr;
	__u32 ts_n;    /* how many timestamp options (the engines read the first, this the last) */
	__u32 sack_at; /* the SACK option */
	__u32 sack_n;  /* its blocks (1-4) */
};

/* One IP/TCP packet, parsed once. */
struct fp_pkt {
	__u32 l4;      /* offset of the TCP header in the skb */
	__u32 l4_len;  /* TCP header and payload, from the IP header's length field */
	__u32 hdr_len; /* TCP header length (data offset * 4) */
	__u32 v6;
	__u32 dscp;    /* the IP header's DSCP */
	__u8 src[16];  /* IPv4 addresses as ::ffff:a.b.c.d */
	__u8 dst[16];
	union {
		struct tcphdr th;
		__u8 hdr[64]; /* the TCP header (hdr_len <= 60), zero beyond; indexes masked */
	};
	struct fp_opts o; /* what fp_scan_options found */
	__u64 csum_diff; /* what the edits of hdr add to the TCP checksum (fp_set32, fp_set16) */
	__u32 dirty;     /* hdr was edited: fp_commit writes it back */
	__u32 walk_at;   /* the options walk: next option */
	__s32 walk_err;
};

struct fp_scratch {
	__u8 buf[FP_CHUNK];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fp_scratch);
} fp_scratch SEC(".maps");

static __always_inline __u32 fp_payload_len(const struct fp_pkt *p)
{
	return p->l4_len - p->hdr_len;
}

/* Parses the IP header at `l3` and the TCP header after it. 0 when the packet is TCP over
 * IPv4 without options and not a fragment, or over IPv6 without extension headers, lengths
 * consistent; -1 otherwise (the slow path's parser decides what such a packet is). */
static __always_inline int fp_parse(struct __sk_buff *skb, __u32 l3, struct fp_pkt *p)
{
	__u8 vhl;

	if (bpf_skb_load_bytes(skb, l3, &vhl, 1))
		return -1;
	if (vhl >> 4 == 4) {
		struct iphdr ip;
		__u32 total;

		if (bpf_skb_load_bytes(skb, l3, &ip, sizeof(ip)))
			return -1;
		if (ip.ihl != 5 || ip.protocol != IPPROTO_TCP)
			return -1;
		if (ip.frag_off & bpf_htons(FP_IP_MF | FP_IP_OFFSET))
			return -1;
		total = bpf_ntohs(ip.tot_len);
		if (total < sizeof(ip) + sizeof(struct tcphdr) || l3 + total > skb->len)
			return -1;
		p->v6 = 0;
		p->dscp = ip.tos >> 2;
		p->l4 = l3 + sizeof(ip);
		p->l4_len = total - sizeof(ip);
		p->src[10] = p->src[11] = p->dst[10] = p->dst[11] = 0xff;
		__builtin_memcpy(&p->src[12], &ip.saddr, 4);
		__builtin_memcpy(&p->dst[12], &ip.daddr, 4);
	} else if (vhl >> 4 == 6) {
		struct ipv6hdr ip6;
		__u32 plen;

		if (bpf_skb_load_bytes(skb, l3, &ip6, sizeof(ip6)))
			return -1;
		if (ip6.nexthdr != IPPROTO_TCP)
			return -1;
		plen = bpf_ntohs(ip6.payload_len);
		if (plen < sizeof(struct tcphdr) || l3 + sizeof(ip6) + plen > skb->len)
			return -1;
		p->v6 = 1;
		p->dscp = ((ip6.priority << 4) | (ip6.flow_lbl[0] >> 4)) >> 2;
		p->l4 = l3 + sizeof(ip6);
		p->l4_len = plen;
		__builtin_memcpy(p->src, &ip6.saddr, 16);
		__builtin_memcpy(p->dst, &ip6.daddr, 16);
	} else {
		return -1;
	}
	if (bpf_skb_load_bytes(skb, p->l4, &p->th, sizeof(p->th)))
		return -1;
	p->hdr_len = p->th.doff * 4;
	if (p->hdr_len < sizeof(struct tcphdr) || p->hdr_len > p->l4_len)
		return -1;
	__u32 olen = p->hdr_len - sizeof(struct tcphdr);
	if (olen > 40)
		return -1;
	if (olen && bpf_skb_load_bytes(skb, p->l4 + sizeof(struct tcphdr), &p->hdr[sizeof(struct tcphdr)], olen))
		return -1;
	return 0;
}

/* 0 when the stack will carry this packet on from a tc ingress program's point of view: a
 * packet for this host (not PACKET_OTHERHOST and the like), the IP version its EtherType says,
 * an IPv4 header whose checksum verifies and a TTL (IPv6: hop limit) above 1, so that
 * forwarding does not drop it, and no IPv4-mapped IPv6 address (the stack drops those). A
 * program that counts what it leaves to the slow path counts only packets that reach it. -1
 * otherwise. */
static __always_inline int fp_forwardable(struct __sk_buff *skb, __u32 l3, const struct fp_pkt *p)
{
	if (skb->pkt_type != 0 /* PACKET_HOST */)
		return -1;
	if (p->v6) {
		__u8 hop;
		if (skb->protocol != bpf_htons(ETH_P_IPV6))
			return -1;
		if (bpf_skb_load_bytes(skb, l3 + 7, &hop, 1) || hop <= 1)
			return -1;
		const __u32 *s = (const __u32 *)p->src, *d = (const __u32 *)p->dst;
		if (!s[0] && !s[1] && s[2] == bpf_htonl(0xffff))
			return -1;
		if (!d[0] && !d[1] && d[2] == bpf_htonl(0xffff))
			return -1;
		return 0;
	}
	struct iphdr ip;
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return -1;
	if (bpf_skb_load_bytes(skb, l3, &ip, sizeof(ip)) || ip.ttl <= 1)
		return -1;
	__s64 sum = bpf_csum_diff(0, 0, (__be32 *)&ip, sizeof(ip), 0);
	if (sum < 0)
		return -1;
	__u64 x = (__u64)sum;
	x = (x & 0xffff) + (x >> 16);
	x = (x & 0xffff) + (x >> 16);
	x = (x & 0xffff) + (x >> 16);
	return x == 0xffff ? 0 : -1;
}

/* The option byte at `i` (relative to the first option). */
static __always_inline __u32 fp_opt8(const struct fp_pkt *p, __u32 i)
{
	return p->hdr[FP_BOUND(sizeof(struct tcphdr) + i, 63)];
}

static __always_inline __u32 fp_opt32(const struct fp_pkt *p, __u32 i)
{
	return (fp_opt8(p, i) << 24) | (fp_opt8(p, i + 1) << 16) | (fp_opt8(p, i + 2) << 8) | fp_opt8(p, i + 3);
}

/* One step of the options walk (a bpf_loop callback, so the verifier checks it once instead
 * of every path through 40 iterations): 0 to go on, 1 to stop. */
static long fp_option_step(__u32 n, void *ctx)
{
	struct fp_pkt *p = ctx;
	__u32 olen = p->hdr_len - sizeof(struct tcphdr);
	__u32 i = p->walk_at;

	if (i >= olen || i >= 40)
		return 1;
	__u32 kind = fp_opt8(p, i);
	if (kind == FP_OPT_EOL)
		return 1;
	if (kind == FP_OPT_NOP) {
		p->walk_at = i + 1;
		return 0;
	}
	if (i + 1 >= olen)
		goto bad;
	__u32 len = fp_opt8(p, i + 1);
	if (len < 2 || i + len > olen)
		goto bad;
	switch (kind) {
	case FP_OPT_TIMESTAMP:
		if (len != 10 || (i & 1))
			goto bad;
		p->o.ts_at = sizeof(struct tcphdr) + i;
		p->o.ts_n++;
		p->o.tsval = fp_opt32(p, i + 2);
		p->o.tsecr = fp_opt32(p, i + 6);
		break;
	case FP_OPT_SACK:
		if (len < 10 || len > 34 || (len - 2) % 8 || (i & 1))
			goto bad;
		p->o.sack_at = sizeof(struct tcphdr) + i;
		p->o.sack_n = (len - 2) / 8;
		break;
	case FP_OPT_MSS:
		if (len != 4)
			goto bad;
		break;
	case FP_OPT_WSCALE:
		if (len != 3)
			goto bad;
		break;
	case FP_OPT_SACK_PERM:
		if (len != 2)
			goto bad;
		break;
	default:
		goto bad;
	}
	p->walk_at = i + len;
	return 0;
bad:
	p->walk_err = -1;
	return 1;
}

/* The options walk of the engines (I1 / O2, unbroken_wire::tcp::OptionSlots) into p->o: -1 for
 * a malformed option (the engine's error) and for an option the engines do not know (which they
 * overwrite with NOPs: left to the slow path); EOL ends the walk. Also -1 when a rewritten
 * option field would sit at an odd offset (never the case in segments Linux builds), where an
 * incremental 32-bit checksum update does not apply. */
static __always_inline int fp_scan_options(struct fp_pkt *p)
{
	p->walk_at = 0;
	p->walk_err = 0;
	if (bpf_loop(40, fp_option_step, p, 0) < 0)
		return -1;
	return p->walk_err;
}

static __always_inline __u32 fp_fold(__u64 s)
{
	s = (s & 0xffffffff) + (s >> 32);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u32)s;
}

/* The sum of the TCP pseudo-header (RFC 793, RFC 8200 section 8.1), unfolded; negative when
 * the kernel refused. */
static __always_inline __s64 fp_pseudo_sum(const struct fp_pkt *p)
{
	if (p->v6) {
		struct {
			__u8 src[16];
			__u8 dst[16];
			__be32 len;
			__be32 proto;
		} ph = {};
		__builtin_memcpy(ph.src, p->src, 16);
		__builtin_memcpy(ph.dst, p->dst, 16);
		ph.len = bpf_htonl(p->l4_len);
		ph.proto = bpf_htonl(IPPROTO_TCP);
		return bpf_csum_diff(0, 0, (__be32 *)&ph, sizeof(ph), 0);
	}
	struct {
		__u8 src[4];
		__u8 dst[4];
		__u8 zero;
		__u8 proto;
		__be16 len;
	} ph = {};
	__builtin_memcpy(ph.src, &p->src[12], 4);
	__builtin_memcpy(ph.dst, &p->dst[12], 4);
	ph.proto = IPPROTO_TCP;
	ph.len = bpf_htons(p->l4_len);
	return bpf_csum_diff(0, 0, (__be32 *)&ph, sizeof(ph), 0);
}

/* 1 when the checksum field holds what a host puts there before its NIC (or the stack, on
 * the way out) completes the checksum: the folded pseudo-header sum (CHECKSUM_PARTIAL). */
static __always_inline int fp_l4_csum_partial(const struct fp_pkt *p)
{
	__s64 sum = fp_pseudo_sum(p);

	return sum >= 0 && fp_fold(sum) == p->th.check;
}

/* 1 when the TCP checksum verifies over the pseudo-header and the whole segment (as the
 * engine's PeerChecksum::Verify does), 0 otherwise. Summed in FP_CHUNK pieces copied into a
 * per-CPU buffer, so it works on non-linear skbs. */
static __always_inline int fp_l4_csum_ok(struct __sk_buff *skb, const struct fp_pkt *p)
{
	__u32 zero = 0;
	struct fp_scratch *s = bpf_map_lookup_elem(&fp_scratch, &zero);
	__s64 sum;

	if (!s)
		return 0;
	sum = fp_pseudo_sum(p);
	if (sum < 0)
		return 0;
	__u32 off = p->l4, left = p->l4_len;
	for (int i = 0; i < FP_CHUNKS; i++) {
		if (left < FP_CHUNK)
			break;
		if (bpf_skb_load_bytes(skb, off, s->buf, FP_CHUNK))
			return 0;
		sum = bpf_csum_diff(0, 0, (__be32 *)s->buf, FP_CHUNK, fp_fold(sum));
		if (sum < 0)
			return 0;
		off += FP_CHUNK;
		left -= FP_CHUNK;
	}
	if (left >= FP_CHUNK)
		return 0;
	if (left) {
		__u32 n = FP_BOUND(left, FP_CHUNK - 1);
		if (n == 0)
			return 0;
		/* Zero the word the tail ends in, then load the tail over it: the sum of a
		 * zero-padded tail is the RFC 1071 sum of the odd bytes. */
		*(__u32 *)&s->buf[n & (FP_CHUNK - 4)] = 0;
		if (bpf_skb_load_bytes(skb, off, s->buf, n))
			return 0;
		__u32 words = FP_BOUND(n + 3, 2 * FP_CHUNK - 4);
		if (words == 0 || words > FP_CHUNK)
			return 0;
		sum = bpf_csum_diff(0, 0, (__be32 *)s->buf, words, fp_fold(sum));
		if (sum < 0)
			return 0;
	}
	return fp_fold(sum) == 0xffff;
}

/* Rewrites are edits of the header copy p->hdr, each adding its difference to one checksum
 * update (RFC 1624: ~old + new, as bpf_l4_csum_replace would for the field alone), and
 * fp_commit writes the header back with that update: two helper calls per packet, however many
 * fields changed. The sums are kept in memory order, as the kernel's __wsum is. */

/* The 32-bit field at `at` (even) from `old` to `new` (host order). */
static __always_inline void fp_set32(struct fp_pkt *p, __u32 at, __u32 old, __u32 new)
{
	p->csum_diff += (__u32)~bpf_htonl(old);
	p->csum_diff += bpf_htonl(new);
	p->hdr[FP_BOUND(at, 63)] = new >> 24;
	p->hdr[FP_BOUND(at + 1, 63)] = new >> 16;
	p->hdr[FP_BOUND(at + 2, 63)] = new >> 8;
	p->hdr[FP_BOUND(at + 3, 63)] = new;
	p->dirty = 1;
}

/* The 16-bit field at `at` (even) from `old` to `new` (host order). */
static __always_inline void fp_set16(struct fp_pkt *p, __u32 at, __u16 old, __u16 new)
{
	p->csum_diff += (__u16)~bpf_htons(old);
	p->csum_diff += bpf_htons(new);
	p->hdr[FP_BOUND(at, 63)] = new >> 8;
	p->hdr[FP_BOUND(at + 1, 63)] = new;
	p->dirty = 1;
}

/* Writes the edited header back and updates the TCP checksum by the summed difference
 * (incrementally; a partial checksum, of a locally built packet, is left to the stack by
 * bpf_l4_csum_replace). 0, or -1 when the kernel refused (the skb could not be made writable). */
static __always_inline int fp_commit(struct __sk_buff *skb, struct fp_pkt *p)
{
	if (!p->dirty)
		return 0;
	__u32 len = FP_BOUND(p->hdr_len, 63);
	if (len < sizeof(struct tcphdr) || len > 60)
		return -1;
	if (bpf_skb_store_bytes(skb, p->l4, p->hdr, len, 0))
		return -1;
	__u64 d = p->csum_diff;
	d = (d & 0xffffffff) + (d >> 32);
	d = (d & 0xffffffff) + (d >> 32);
	/* Size 0: `to` is a checksum difference, `from` must be 0. */
	return bpf_l4_csum_replace(skb, p->l4 + FP_TCP_CHECK, 0, (__u32)d, 0) ? -1 : 0;
}
