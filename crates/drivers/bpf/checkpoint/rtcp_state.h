/* Checkpoint mode's map: one entry per protected connection, keyed by its address pair, whose
 * value is byte for byte the RTCP engine's state (unbroken_engines::rtcp::Conn, 36 bytes,
 * #[repr(C)]; the Rust mirror is unbroken_drivers::fastpath::checkpoint::State, and a test
 * checks these flag values against rtcp::flag). */
#pragma once

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
