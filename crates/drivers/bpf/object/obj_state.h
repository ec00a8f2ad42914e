/* Object mode's fast-path state: one entry per connection in `obj_slots`, found through
 * `obj_index` by the client's and the service's endpoints. Part of it is published by the agent from the
 * TRODS engine's state (trods::Engine::fast_view: the walls the kernel may not cross without
 * the engine), part is kept by the kernel as packets pass (what the engine would have counted
 * had it seen them); the agent reads that part back when the connection's next packet goes to
 * the slow path (docs/architecture.md, "Fast path: object mode").
 *
 * Stream positions are the engine's 64-bit stream offsets (byte 0 = the first byte after the
 * SYN). The Rust mirror is drivers::fastpath::object::{Key, State}; offsets are asserted on
 * both sides.
 */
#pragma once

#include <linux/types.h>

struct obj_key {
	__u8 client_addr[16];  /* IPv4 as ::ffff:a.b.c.d */
	__u8 service_addr[16];
	__u8 client_port[2];   /* network order */
	__u8 service_port[2];
};

/* Flags (struct obj_conn.flags). The first four are published by the agent. */
/* Client pure ACKs may pass (the engine's state is quiet: see the table). */
#define OBJ_F_CLIENT_FAST (1u << 0)
/* Server segments may pass (continuing a stored response's body, ACK lowered by tc). */
#define OBJ_F_SERVER_FAST (1u << 1)
/* `bucket` is the connection's bucket as the agent's core recorded it. */
#define OBJ_F_BUCKET_KNOWN (1u << 2)
/* No load balancer (the gate open by configuration): server packets are not fenced. */
#define OBJ_F_NO_FENCE (1u << 3)
/* An unprotected connection (its responses cannot be resumed: chunked, credentials, no
 * validator; or learned after an agent restart without a record that describes it), its
 * tombstone stored: the engine parses nothing, prunes nothing and holds nothing, so neither
 * the response walls nor client_acked and srv_next apply (they do not move). */
#define OBJ_F_PASSTHROUGH (1u << 4)
/* Set by the kernel (atomically) when it sent a packet of the connection to the slow path:
 * from then on both directions go slow until the agent publishes the entry again. */
#define OBJ_F_USER (1u << 8)

/* "No limit" for ack_limit, "no wall" for the walls. */
#define OBJ_NONE (~0ULL)

struct obj_conn {
	/* Published by the agent. */
	__u64 cli_next;    /* the client stream's position (Conn::cli_next) */
	__u64 ack_wall;    /* a client ACK at or past this server offset goes slow (the first
			    * stored response's end: the ACK that prunes it) */
	__u64 body_end;    /* new server bytes may pass up to this offset (the end of the body
			    * being parsed; srv_next between responses) */
	__u64 sent_wall;   /* a server segment bringing sent_next to this goes slow (a progress
			    * mark is due, or the stored one would be too far behind) */
	__u64 ack_limit;   /* client offset the server's ACK is lowered to (OBJ_NONE: none) */
	__u64 srv_ack;     /* the server's highest ACK seen (client offset) */
	__u64 srv_ack_cap; /* srv_ack never counts past this (cli_next, one more after a FIN) */
	__u64 told;        /* what the client was told (client offset) */
	__u32 iss;
	__u32 irs;
	__u32 flags;       /* OBJ_F_*; OBJ_F_USER set by the kernel with an atomic or */
	__u32 wseq;        /* odd while a fast-path program writes the kept fields */
	__u16 bucket;
	__u8 server_ws;
	__u8 has_ts;       /* kept: last_tsval/last_tsecr hold the server's latest timestamps */
	__u16 last_window; /* kept: the server's latest window field */
	__u16 pub_gen; /* the agent's publication: +1 at every publish (a program re-checks it before writing) */
	/* Kept by the kernel (initialised by the agent at each publication). */
	__u64 client_acked; /* Conn::client_acked */
	__u64 srv_next;     /* Conn::srv_next */
	__u64 sent_next;    /* Conn::sent_next */
	__u64 last_seen_ns; /* CLOCK_MONOTONIC of the latest packet either way (Conn::last_seen) */
	__u32 last_tsval;   /* Conn::last_ts */
	__u32 last_tsecr;
};

_Static_assert(sizeof(struct obj_key) == 36, "obj_key");
_Static_assert(sizeof(struct obj_conn) == 128, "obj_conn");
_Static_assert(__builtin_offsetof(struct obj_conn, iss) == 64, "obj_conn.iss");
_Static_assert(__builtin_offsetof(struct obj_conn, flags) == 72, "obj_conn.flags");
_Static_assert(__builtin_offsetof(struct obj_conn, bucket) == 80, "obj_conn.bucket");
_Static_assert(__builtin_offsetof(struct obj_conn, client_acked) == 88, "obj_conn.client_acked");
_Static_assert(__builtin_offsetof(struct obj_conn, last_tsval) == 120, "obj_conn.last_tsval");

/* obj_leases has one entry per bucket, and one more: the agent's own lease, CLOCK_MONOTONIC
 * ns until which the agent that published the entries is alive (it writes it every round of
 * its loop). Once it lapses (the agent died, was killed, or stalls) both filters pass nothing:
 * every packet of a known connection goes to the slow path, as with no fast path at all (a
 * dead agent's queue drops it; a successor's rules replace these filters). */
#define OBJ_BUCKETS 65536
#define OBJ_ALIVE_SLOT OBJ_BUCKETS

/* Counters (obj_counters, per CPU). */
#define OBJ_C_CLIENT_PASSED 0
#define OBJ_C_CLIENT_SLOW 1
#define OBJ_C_SERVER_PASSED 2
#define OBJ_C_SERVER_SLOW 3
#define OBJ_C_ACKS_LOWERED 4
#define OBJ_C_N 8
