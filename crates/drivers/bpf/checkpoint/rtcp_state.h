/* Checkpoint mode's map: one entry per protected connection, keyed by its address pair, whose
 * value is byte for byte the RTCP engine's state (unbroken_engines::rtcp::Conn, 36 bytes,
 * #[repr(C)]; the Rust mirror is unbroken_drivers::fastpath::checkpoint::State, and a test
 * checks these flag values against rtcp::flag). */
#pragma once

#include <linux/bpf.h>
#include <linux/types.h>

/* *A* is the protected application, *B* its peer. IPv4 addresses as ::ffff:a.b.c.d; ports in
 * network order, as in the packet. */
struct ckpt_key {
	__u8 a_addr[16];
	__u8 b_addr[16];
	__be16 a_port;
	__be16 b_port;
};

/* unbroken_engines::rtcp::Conn, field by field (see its docs for each). */
struct rtcp_conn {
	__u32 delta;  /* Δ: outgoing SEQ -= Δ (O8), incoming ACK += Δ (I3) */
	__u32 ack_b;  /* B's latest acknowledgment */
	__u32 ack_a;  /* the checkpoint (O7) */
	__u32 ts_b;   /* B's latest TSval */
	__u32 ts_a;   /* latest TSval B saw from A */
	__u32 ts_off; /* added to A's TSval, subtracted from B's TSecr */
	__u32 a_end;  /* end of what A's current socket sent, in B's view */
	__u16 b_mss;
	__u16 a_win;  /* last window field B saw from A */
	__u8 ws;      /* low nibble: B's scale; high: A's scale as B applies it (15 = none) */
	__u8 ws_cur;  /* low nibble: the scale of A's current socket */
	__u16 flags;  /* RTCP_F_* */
};

_Static_assert(sizeof(struct ckpt_key) == 36, "ckpt_key is 36 bytes");
_Static_assert(sizeof(struct rtcp_conn) == 36, "rtcp_conn mirrors rtcp::Conn (36 bytes)");
_Static_assert(__builtin_offsetof(struct rtcp_conn, a_end) == 24, "a_end at 24");
_Static_assert(__builtin_offsetof(struct rtcp_conn, b_mss) == 28, "b_mss at 28");
_Static_assert(__builtin_offsetof(struct rtcp_conn, ws) == 32, "ws at 32");
_Static_assert(__builtin_offsetof(struct rtcp_conn, flags) == 34, "flags at 34");

/* The map's value: the engine's state, what the guard keeps beside it that the fast path must
 * keep too, and the hand-off between the paths (docs/architecture.md, "Fast path", and
 * unbroken_drivers::fastpath::checkpoint::Entry, its Rust mirror).
 *
 * The hand-off. An entry is the fast path's while CKPT_C_FROZEN is clear: the programs update it
 * under `lock`. A program that leaves a packet of the connection to the slow path sets
 * CKPT_C_FROZEN, counts the packet in `slow` and marks it CKPT_MARK_SLOW; while frozen every
 * packet of the connection goes the slow way (counted, marked) and nothing in the entry changes.
 * The daemon takes a frozen entry's state (ckpt_op CKPT_OP_TAKE for a marked packet, counting
 * it in `seen`; CKPT_OP_FREEZE otherwise: a command, an unmarked packet) and sets CKPT_C_USER:
 * from then on the daemon's copy is the newest. It gives the connection back (CKPT_OP_THAW) only
 * when every packet the programs sent its way has been taken (`seen == slow`): no packet of the
 * connection is then between the paths, and the written state is exact. */
struct ckpt_entry {
	struct bpf_spin_lock lock;
	__u32 ctl;     /* CKPT_C_* */
	__u32 slow;    /* packets of this entry the programs left to the slow path */
	__u32 seen;    /* of those, how many the daemon took (CKPT_OP_TAKE) */
	__u32 a_hi;    /* the guard's end of what A ever sent (with CKPT_C_A_HI) */
	__u32 peer_lo; /* the guard's highest data segment from B (with CKPT_C_PEER) */
	__u32 peer_hi;
	struct rtcp_conn conn;
};

_Static_assert(sizeof(struct ckpt_entry) == 64, "ckpt_entry is 64 bytes");
_Static_assert(__builtin_offsetof(struct ckpt_entry, conn) == 28, "conn at 28");

/* ckpt_entry.ctl (one value per line: the Rust mirror's test reads them). */
#define CKPT_C_FROZEN (1 << 0)
#define CKPT_C_USER (1 << 1)
#define CKPT_C_A_HI (1 << 2)
#define CKPT_C_PEER (1 << 3)

/* Bits the programs OR into skb->mark: CKPT_MARK_DONE on a packet the fast path decided (the
 * steering chain's first rule RETURNs it, so it does not reach the queue), CKPT_MARK_SLOW on one
 * of a connection with an entry, counted in `slow` (the daemon takes it with CKPT_OP_TAKE). */
#define CKPT_MARK_DONE 0x20000000
#define CKPT_MARK_SLOW 0x10000000

/* The daemon's operations on an entry (program ckpt_op, run by BPF_PROG_TEST_RUN with a
 * struct ckpt_op_req after a 14-byte Ethernet header; the answer, struct ckpt_op_ans, is
 * written over the request). */
#define CKPT_OP_TAKE 1
#define CKPT_OP_FREEZE 2
#define CKPT_OP_THAW 3
#define CKPT_OP_THAW_FORCE 4
/* RTCP C2 for a connection the programs own: the checkpoint (value.conn.ack_a) raised in
 * place, as rtcp::command does it for ACKNOWLEDGE, so that a checkpoint reaches the data path
 * without freezing it. Only where C2 changes nothing but ack_a and a_win (a checkpoint was
 * set before, the options are known); otherwise, and on a frozen entry, result 4: the daemon
 * takes the connection instead. */
#define CKPT_OP_ACK 5

struct ckpt_op_req {
	__u32 op;
	__u32 pad;
	struct ckpt_key key;
	/* For THAW: the state to write (ctl's CKPT_C_A_HI and CKPT_C_PEER, a_hi, peer_lo,
	 * peer_hi, conn; lock, slow and seen are ignored). */
	struct ckpt_entry value;
};

/* result: 0 done; 1 no entry; 2 THAW refused: a packet is still between the paths (the entry
 * stays frozen and the daemon's); 3 a malformed request; 4 ACK refused (see CKPT_OP_ACK). `value` is the entry after the
 * operation (lock zero). */
struct ckpt_op_ans {
	__u32 result;
	__u32 ctl_before;
	struct ckpt_key key;
	struct ckpt_entry value;
};

_Static_assert(sizeof(struct ckpt_op_req) == 108, "ckpt_op_req is 108 bytes");
_Static_assert(sizeof(struct ckpt_op_ans) == 108, "ckpt_op_ans is 108 bytes");

/* rtcp::flag (one value per line: the test reads them). */
#define RTCP_F_RECOVERABLE (1 << 0)
#define RTCP_F_FIN_ALLOWED (1 << 1)
#define RTCP_F_ACK_ALLOWED (1 << 2)
#define RTCP_F_ACK_EVERYTHING (1 << 3)
#define RTCP_F_OPTS_KNOWN (1 << 4)
#define RTCP_F_SACK_OK (1 << 5)
#define RTCP_F_TS_OK (1 << 6)
#define RTCP_F_TS_A_KNOWN (1 << 7)
#define RTCP_F_TS_B_KNOWN (1 << 8)
#define RTCP_F_SYN_PENDING (1 << 9)
#define RTCP_F_PEND_SACK (1 << 10)
#define RTCP_F_PEND_TS (1 << 11)
#define RTCP_F_ORIGIN_PINNED RTCP_F_PEND_SACK
#define RTCP_F_A_WIN_KNOWN (1 << 12)
#define RTCP_F_FIN_A_SEEN (1 << 13)
#define RTCP_F_FIN_B_SEEN (1 << 14)
#define RTCP_F_SYNCED (1 << 15)

/* Window scale nibble for "none" (rtcp::WS_NONE). */
#define RTCP_WS_NONE 15
