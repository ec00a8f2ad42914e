/* Replica mode's fast path, the backup's half: one map entry per connection the backup's engine
 * has aligned (unbroken_engines::replica::Backup, ST-TCP 3.3.0.1 / Koch 3.1), holding the
 * per-connection fields of the engine's BConn that its per-packet steps read or write in the
 * steady state (docs/architecture.md, "Fast path: replica mode (issue 22, step 1)"). The Rust
 * mirror is unbroken_drivers::fastpath::replica::{Key, State, Entry}; a test checks these flag
 * values against the mirror's. Sequence numbers in host order; ports in network order. */
#pragma once

#include <linux/bpf.h>
#include <linux/types.h>

/* replica::ConnKey: the client's address (IPv4 as ::ffff:a.b.c.d), its port, the service port
 * (the service address is the same on both hosts and not part of the key). */
struct rep_key {
	__u8 client[16];
	__be16 client_port;
	__be16 server_port;
};

/* The engine's BConn fields the programs keep (its names; REP_B_* say which Options are Some). */
struct rep_b_state {
	__u64 out_hash;  /* FNV-1a of the output from the primary's ISN + 1 to out_end */
	__u64 b_ts_at;   /* when b_ts_val was seen: the kernel's clock (ns) in the map */
	__u32 flags;     /* REP_B_* */
	__u32 delta;     /* Δ = ISN(P) - ISN(B) */
	__u32 ts_off;    /* timestamp offset */
	__u32 snd_max;   /* the backup server's SND.MAX (its space) */
	__u32 rcv_nxt;   /* its ACK, client space */
	__u32 rcv_edge;  /* its right window edge */
	__u32 out_end;   /* output end, primary's space */
	__u32 last_ack;  /* the client's latest ACK (primary's space) */
	__u32 acked_b;   /* the highest ACK handed to its server (its space) */
	__u32 p_out;     /* the end of output the primary verified (its reports) */
	__u32 ts_floor;  /* the newest TSval the client has seen */
	__u32 cts_max_val; /* client_ts_max: newest client TSval (and its TSecr) taken */
	__u32 cts_max_ecr;
	__u32 cts_val;   /* client_ts: the timestamps of last_ack's segment */
	__u32 cts_ecr;
	__u32 b_ts_val;  /* b_ts_seen: the newest TSval of the backup's server */
	__u8 server[16]; /* the service address the client sent to */
	__u16 client_win;
	__u8 ws_b;       /* the backup's window shift */
	__u8 pad;
	__u32 pad2;
};

_Static_assert(sizeof(struct rep_key) == 20, "rep_key is 20 bytes");
_Static_assert(sizeof(struct rep_b_state) == 104, "rep_b_state is 104 bytes");
_Static_assert(__builtin_offsetof(struct rep_b_state, server) == 80, "server at 80");

/* rep_b_state.flags (one value per line: the Rust test reads them). */
#define REP_B_ALIGNED (1 << 0)
#define REP_B_RCV_KNOWN (1 << 1)
#define REP_B_CLIENT_SEEN (1 << 2)
#define REP_B_ACKED_B (1 << 3)
#define REP_B_P_OUT (1 << 4)
#define REP_B_TS_FLOOR (1 << 5)
#define REP_B_CTS_MAX (1 << 6)
#define REP_B_CTS (1 << 7)
#define REP_B_B_TS (1 << 8)
#define REP_B_SERVER (1 << 9)
/* The pair runs strict output commit (Backup::set_strict). */
#define REP_B_STRICT (1 << 10)

/* The map value. The hand-off is checkpoint mode's (bpf/checkpoint/rtcp_state.h): an entry is
 * the programs' while REP_C_FROZEN is clear; a program that leaves a packet of the connection
 * to the slow path freezes it and counts the packet in `slow`; the daemon takes the state
 * (REP_OP_TAKE, counting in `seen`; REP_OP_FREEZE) and gives it back (REP_OP_THAW) only when
 * `seen == slow`. `gen` counts the entry's changes: a program reads the state under the lock,
 * computes outside it (the digest of a segment is a helper loop, which the lock forbids), and
 * writes only if `gen` did not move meanwhile (else the packet goes the slow way).
 * REP_C_CHANGED: a packet of the backup's server moved the figures the primary waits for since
 * the daemon last collected them (REP_OP_COLLECT): the program that sets it sends one
 * REP_REC_CHANGED record, so the daemon learns of a connection once per report, not once per
 * packet. */
struct rep_b_entry {
	struct bpf_spin_lock lock;
	__u32 ctl;  /* REP_C_* */
	__u32 slow;
	__u32 seen;
	__u32 gen;
	__u32 pad;
	struct rep_b_state s;
};

_Static_assert(sizeof(struct rep_b_entry) == 128, "rep_b_entry is 128 bytes");
_Static_assert(__builtin_offsetof(struct rep_b_entry, s) == 24, "s at 24");

#define REP_C_FROZEN (1 << 0)
#define REP_C_USER (1 << 1)
#define REP_C_CHANGED (1 << 2)

/* skb->mark bits, as checkpoint mode's: decided on the fast path / left to it for the daemon. */
#define REP_MARK_DONE 0x20000000
#define REP_MARK_SLOW 0x10000000

/* Records the programs send the daemon through the ring buffer `rep_records`, in order. */
#define REP_REC_CHANGED 1    /* the connection's figures moved (see REP_C_CHANGED) */
#define REP_REC_CHECKPOINT 2 /* learn_output's checkpoint: a = out_end, hash = out_hash */
/* A piece of a withheld segment the engine keeps for the take-over (BConn::kept): a = its end
 * in the backup's space, b = the IP packet's length, off = where this piece starts in it; the
 * piece's bytes follow the header (len of them). */
#define REP_REC_KEEP 3

struct rep_rec {
	__u32 type;
	__u32 len;
	__u32 a;
	__u32 b;
	__u32 off;
	__u32 cpu; /* pieces (KEEP, SLOW, INPUT): the CPU that wrote them, and */
	__u64 hash;
	struct rep_key key;
	__u32 id; /* that CPU's number of their packet (0 in other records) */
};

_Static_assert(sizeof(struct rep_rec) == 56, "rep_rec is 56 bytes");

/* A piece of a packet of the service that an egress program declined while attached in copy
 * mode (REP_CFG_EGRESS_COPY): consumed, its bytes for the daemon, whose engine decides it (the
 * backup withholds it anyway; the primary's raw socket sends what its engine accepts). b = the
 * IP packet's length, off = where this piece starts; key from the packet (zero if unparsed);
 * a = 1 when the packet was counted in its entry's `slow` (as a packet marked REP_MARK_SLOW:
 * the daemon takes it with REP_OP_TAKE), 0 when it had no entry. */
#define REP_REC_SLOW 4
/* A piece of a client segment with bytes that rep_b_in passed to the backup's server: a copy for
 * the primary (the engine's Backup::push_input). b, off and the bytes as for REP_REC_KEEP. */
#define REP_REC_INPUT 5

/* The programs' configuration (map rep_cfg, one entry). */
struct rep_cfg {
	__u32 flags; /* REP_CFG_* */
	__u32 own_mark; /* the daemon's raw sends (SO_MARK): passed untouched at egress; 0: none */
	/* The primary's lease (the kernel's clock, ns; 0: none): its daemon renews it while it
	 * runs; past it rep_p_in and rep_p_out claim nothing, so a dead daemon's filter fails
	 * closed as its queue rules do (its server's output copied to a ring no one reads). */
	__u64 lease;
};

/* At tc egress a declined packet would go to the wire untranslated or ungated: in copy mode
 * every packet of the service (rep_services) that an egress program declines is copied to the
 * daemon (REP_REC_SLOW) and consumed. Off: FP_SLOW, untouched (BPF_PROG_TEST_RUN's tests). */
#define REP_CFG_EGRESS_COPY (1 << 0)
/* The backup took over: the OUTPUT queue rule's match (rep_q_out) takes the server's packets;
 * rep_b_out passes what the queue accepted (marked own_mark) and copies the rest. */
#define REP_CFG_PROMOTED (1 << 1)
/* The daemon takes its server's output through the queue again (the egress filter is gone:
 * review finding 5): the OUTPUT queue rule's match (rep_q_out) takes every packet. */
#define REP_CFG_USER_OUT (1 << 2)

/* A service endpoint (rep_services): the address (IPv4 as ::ffff:a.b.c.d) and port. */
struct rep_svc {
	__u8 addr[16];
	__be16 port;
	__u16 pad;
};

/* Bytes of a withheld packet per REP_REC_KEEP record. */
#define REP_KEEP_PIECE 2048

/* The daemon's operations (program rep_op, run by BPF_PROG_TEST_RUN; request after a 14-byte
 * Ethernet header, the answer written over it). */
#define REP_OP_TAKE 1
#define REP_OP_FREEZE 2
#define REP_OP_THAW 3
#define REP_OP_THAW_FORCE 4
/* The entry as it is, REP_C_CHANGED cleared (the daemon reports its figures now). */
#define REP_OP_COLLECT 5
/* The primary's only: one record of the backup's report applied in place (rep_p_op), the entry
 * left to the programs unless the engine would answer the record with a packet (then frozen,
 * result 4: the daemon's, as after REP_OP_FREEZE). The request's state carries the record:
 * flags REP_P_B_RCV_KNOWN / REP_P_B_ALIGNED, b_rcv_nxt, b_rcv_edge, and in client_ack the
 * client's ACK as the backup heard it (0: none). */
#define REP_OP_REPORT 6
/* What rep_p_op answers REP_OP_REPORT when it froze the entry. */
#define REP_OP_TAKEN 4
/* The engine's ACK_RELAY_AFTER_MS less a margin: REP_OP_REPORT freezes every entry whose
 * client the engine may count as quiet (its clock in whole milliseconds, read a little later). */
#define REP_P_RELAY_QUIET_NS (18ULL * 1000 * 1000)

struct rep_op_req {
	__u32 op;
	__u32 pad;
	struct rep_key key;
	__u32 pad2;
	struct rep_b_entry value; /* THAW: the state to write (value.s) */
};

/* result: 0 done; 1 no entry; 2 THAW refused (a packet between the paths); 3 malformed. */
struct rep_op_ans {
	__u32 result;
	__u32 ctl_before;
	struct rep_key key;
	__u32 pad2;
	struct rep_b_entry value;
};

_Static_assert(sizeof(struct rep_op_req) == 160, "rep_op_req is 160 bytes");
_Static_assert(sizeof(struct rep_op_ans) == 160, "rep_op_ans is 160 bytes");

/* The primary's half (unbroken_engines::replica::Primary, Koch 3.2, ST-TCP 3.6): the PConn
 * fields its steady-state pure-ACK steps read or write (docs/architecture.md, the table). */
struct rep_p_state {
	__u64 heard_at;     /* client_heard_at: the kernel's clock (ns) in the map */
	__u32 flags;        /* REP_P_* */
	__u32 ack_p;        /* the primary server's latest ACK */
	__u32 edge_p;       /* and right window edge */
	__u32 b_rcv_nxt;    /* the backup's (its reports: BRec) */
	__u32 b_rcv_edge;
	__u32 ts_val;       /* ts: the server's latest timestamps */
	__u32 ts_ecr;
	__u32 ts_max;       /* the newest TSval sent to the client */
	__u32 sent_ack;     /* the highest ACK sent to the client */
	__u32 snd_p;        /* the primary server's SND.MAX */
	__u32 p_max;
	__u32 stream_start; /* ISN + 1 */
	__u32 client_ack;   /* ST-TCP 3.6's LastAckReceived */
	__u32 cl_end;       /* client_last: end of its data, window, timestamps */
	__u32 cl_ts_val;
	__u32 cl_ts_ecr;
	__u16 cl_win;
	__u8 ws_p;
	__u8 pad;
	__u32 rel;          /* released (verified, or passed without strict mode) up to here */
	__u32 p_end;        /* the end of the primary server's output */
	__u32 snd_c;        /* the highest sequence number the client has been sent */
	__u32 pad2;
};

_Static_assert(sizeof(struct rep_p_state) == 96, "rep_p_state is 96 bytes");

#define REP_P_ANSWERED (1 << 0)
#define REP_P_ESTABLISHED (1 << 1)
#define REP_P_B_RCV_KNOWN (1 << 2)
#define REP_P_TS (1 << 3)
#define REP_P_TS_MAX (1 << 4)
#define REP_P_SENT_ACK (1 << 5)
#define REP_P_CLIENT_LAST (1 << 6)
#define REP_P_CL_TS (1 << 7)
/* The backup has reported the connection (PConn::b is Some). */
#define REP_P_B (1 << 8)
/* The backup reported its alignment (BRec::aligned). */
#define REP_P_B_ALIGNED (1 << 9)
#define REP_P_OUT_SEEN (1 << 10)
/* The primary runs strict output commit (Config::strict). */
#define REP_P_STRICT (1 << 11)

/* Same header as rep_b_entry (the helpers of rep_tc.c use it through that type). */
struct rep_p_entry {
	struct bpf_spin_lock lock;
	__u32 ctl;
	__u32 slow;
	__u32 seen;
	__u32 gen;
	__u32 pad;
	struct rep_p_state s;
};

_Static_assert(sizeof(struct rep_p_entry) == 120, "rep_p_entry is 120 bytes");

struct rep_p_op_req {
	__u32 op;
	__u32 pad;
	struct rep_key key;
	__u32 pad2;
	struct rep_p_entry value;
};

_Static_assert(sizeof(struct rep_p_op_req) == 152, "rep_p_op_req is 152 bytes");
