/*
 * unbroken.h - C API of the unbroken application SDK (checkpoint mode, RTCP).
 *
 * A guard (packet filter) between the application A and its peer B keeps A's TCP
 * connections alive across crashes of A (Surton et al., "Man-in-the-Middle TCP Recovery").
 * The application takes part through an authenticated UDP side channel to the guard:
 *
 *   after accept()/connect(), before sending:  ub_establish()  -> persist the ub_record
 *   input stored or processed durably:          ub_acknowledge(consumed_total)
 *   recv() returned 0 and all is persisted:     ub_acknowledge_eof(consumed_total)
 *   after the last send(), before close():      ub_shutdown(UB_SHUT_RDWR)
 *   connection fully closed (TIME-WAIT over):   ub_clear()
 *   after a crash, or ECONNRESET from the guard: ub_recover(consumed_total, sent_total)
 *                                               -> new fd; resend output from delivered
 *
 * The application persists, with its own checkpoint, the ub_record (once) and two
 * counters: consumed_total (input bytes safely stored/processed) and sent_total (output
 * bytes journaled and then written; journal output BEFORE writing it, so it can be resent
 * after a recovery).
 *
 * A server that recovers connections while listening must listen with SO_REUSEPORT
 * (ub_listen() does that): on Linux, bind() to a port that has a listening socket fails
 * with EADDRINUSE unless both sockets have SO_REUSEPORT (same effective user). Otherwise,
 * recover all connections before calling listen().
 *
 * All functions return UB_OK (0) or a negative UB_E* code, check pointers for NULL, and are
 * safe to call from several threads on one ub_client (requests are serialized), except
 * ub_client_set_timeouts() and ub_client_free(). On UB_EIO, errno holds the system error.
 *
 * Link with -lunbroken_sdk (shared) or libunbroken_sdk.a plus -lpthread -ldl -lm (static).
 * Linux (TCP_INFO, SO_REUSEPORT). C99.
 */
#ifndef UNBROKEN_H
#define UNBROKEN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes. */
#define UB_OK               0   /* success */
#define UB_EINVAL          (-1) /* invalid argument: NULL pointer, bad address/key/how/fd */
#define UB_ETIMEDOUT       (-2) /* nothing answered: no guard at that address, or it drops our source */
#define UB_ENOCONN         (-3) /* the guard has no state for this connection */
#define UB_EBADREQ         (-4) /* the guard found the command malformed */
#define UB_EREJECTED       (-5) /* the guard answered with another non-zero status */
#define UB_ENOTRECOVERABLE (-6) /* the guard cannot (yet) recover this connection */
#define UB_ERECORD         (-7) /* record corrupt, of another version, or not this connection */
#define UB_EDELIVERED      (-8) /* the peer acknowledged more bytes than `sent` */
#define UB_EIO             (-9) /* a system call failed; see errno */
#define UB_EINTERNAL      (-10) /* internal error (bug) */
#define UB_EKEY           (-11) /* the guard rejected our side-channel key (MAC check failed) */
#define UB_ECLOCK         (-12) /* the guard rejected our clock (too far from its own) */

/* `how` for ub_shutdown(). */
#define UB_SHUT_RD   0 /* RTCP_SHUTDOWN_READING: no more input expected */
#define UB_SHUT_WR   1 /* RTCP_SHUTDOWN_WRITING: no more output; FINs are genuine */
#define UB_SHUT_RDWR 2 /* RTCP_SHUTDOWN: both, just before close() */

/* Size of a connection record. */
#define UB_RECORD_LEN 64

/*
 * What the application persists for one connection, as is (a stable, versioned, checksummed
 * byte encoding, identical to the Rust ConnRecord::to_bytes): both endpoints, ack_a0 (the
 * peer's ISN + 1), ack_b0 (the application's ISN + 1) and the negotiated TCP options.
 * Treat it as opaque.
 */
typedef struct ub_record {
    uint8_t bytes[UB_RECORD_LEN];
} ub_record;

/* A side-channel client (opaque): UDP socket, guard address, shared key. */
typedef struct ub_client ub_client;

/*
 * Creates a client of the guard at guard_addr ("ip:port", IPv6 as "[addr]:port") with the
 * shared key key_hex (at least 32 hex digits). Returns NULL on error with errno set (EINVAL
 * for bad arguments). Defaults: first wait 50 ms, doubling, 6 datagrams per request (each
 * with a fresh nonce), connect timeout of ub_recover 10 s.
 */
ub_client *ub_client_new(const char *guard_addr, const char *key_hex);

/* Frees a client. NULL is ignored. */
void ub_client_free(ub_client *c);

/*
 * Changes the first wait for an answer (initial_ms, doubled on each retransmission), the
 * number of datagrams per request (tries) and ub_recover's connect timeout. 0 keeps a value.
 */
int ub_client_set_timeouts(ub_client *c, uint32_t initial_ms, uint32_t tries,
                           uint32_t connect_timeout_ms);

/*
 * RTCP_TELL right after accept()/connect() on the connected TCP socket fd (borrowed, not
 * closed), before sending anything. Fills *out with the record to persist durably. Retries
 * briefly while the guard has not seen the end of the handshake; then UB_ENOTRECOVERABLE or
 * UB_ENOCONN. UB_EKEY / UB_ECLOCK / UB_ETIMEDOUT say the guard refused our key or clock, or
 * nothing answered. On any failure fd is marked unprotected (ub_unprotect) so that closing it
 * reaches the peer as without the guard. After a failed ub_probe() (until one succeeds again)
 * it sends nothing and fails at once with the probe's code. Before close(), read what the peer
 * sent (shutdown(fd, SHUT_WR), then read until 0): close() with input unread sends a RST.
 */
int ub_establish(ub_client *c, int fd, ub_record *out);

/* Marks connected TCP socket fd unprotected (DSCP 0x0b in IP_TOS / IPV6_TCLASS): the guard
 * lets its packets through untouched, if no command ever named the connection. */
int ub_unprotect(int fd);

/* At start-up: does a guard answer at the client's address, accept our key and clock, and
 * protect service_addr ("ip:port")? UB_OK, UB_EKEY, UB_ECLOCK, UB_ETIMEDOUT (nothing answers
 * there), UB_EBADREQ (not a service of that guard). The client remembers a failure: until a
 * ub_probe() succeeds, ub_establish() sends nothing and fails at once with the same code. */
int ub_probe(const ub_client *c, const char *service_addr);

/*
 * RTCP_ACKNOWLEDGE: consumed bytes of input (total since the connection began) are safely
 * stored or processed and may be acknowledged to the peer. Idempotent; the guard keeps the
 * highest checkpoint.
 */
int ub_acknowledge(ub_client *c, const ub_record *rec, uint64_t consumed);

/*
 * Like ub_acknowledge(), also acknowledging the peer's FIN: call it when recv() returned 0
 * and everything before is persisted. Persist the end of input yourself: after ub_recover()
 * the FIN is not delivered again (call ub_acknowledge_eof() again after recovering).
 */
int ub_acknowledge_eof(ub_client *c, const ub_record *rec, uint64_t consumed);

/*
 * RTCP_SHUTDOWN_READING (UB_SHUT_RD), RTCP_SHUTDOWN_WRITING (UB_SHUT_WR) or RTCP_SHUTDOWN
 * (UB_SHUT_RDWR). Send UB_SHUT_WR / UB_SHUT_RDWR only after the last send() succeeded,
 * right before shutdown(SHUT_WR) / close(). A later ub_recover() undoes it.
 */
int ub_shutdown(ub_client *c, const ub_record *rec, int how);

/*
 * RTCP_CLEAR: the guard forgets the connection. Only when no packet of it can flow any more.
 */
int ub_clear(ub_client *c, const ub_record *rec);

/*
 * Recovers the connection: RTCP_ACKNOWLEDGE(consumed) with the record's options, a new
 * socket with SO_REUSEADDR + SO_REUSEPORT bound to the original local address and port,
 * connect() to the peer (answered by the guard), RTCP_TELL. On success *fd_out is the new
 * connected, blocking, close-on-exec socket (owned by the caller) and *delivered_out the
 * number of output bytes the peer has received (<= sent): resend journaled output from
 * there. Input resumes at byte `consumed`.
 */
int ub_recover(ub_client *c, const ub_record *rec, uint64_t consumed, uint64_t sent,
               int *fd_out, uint64_t *delivered_out);

/*
 * ADOPT (unbroken's addition to RTCP): the connections to app_addr ("ip:port", the service)
 * that the guard holds but no application has told about -- the application died after its
 * kernel accepted them and before ub_establish(). Up to `max` records are written to out[];
 * *count is how many the guard offered (call again with a larger array if it exceeds max).
 * Persist each record, then ub_recover() it with consumed = 0 and sent = 0. Call at start-up,
 * before accepting, only when this process is the service's sole owner.
 */
int ub_adopt(ub_client *c, const char *app_addr, ub_record *out, size_t max, size_t *count);

/*
 * A listening TCP socket on addr ("ip:port") with SO_REUSEADDR and SO_REUSEPORT, so that
 * ub_recover() can bind its port while it listens. *fd_out is owned by the caller.
 */
int ub_listen(const char *addr, int backlog, int *fd_out);

/* A static English description of a return code; never NULL. */
const char *ub_strerror(int code);

#ifdef __cplusplus
}
#endif

#endif /* UNBROKEN_H */
